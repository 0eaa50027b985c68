# The two commands a user needs: `make demo` and `make test`. Each creates .venv if missing and
# installs jaxcoll with what it needs, so a machine with only Python 3.10+ needs nothing else.
# `make docs` builds the documentation site (docs/, mkdocs.yml) into site/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-slow test-all docs lint typecheck check bench clean test-slurm

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dp,bench,dev,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/run_all.py

# Two workers (the CI machine's cores); --dist loadfile keeps each test file in one worker, so
# the programs a file compiles once serve all its tests. `make test` leaves out the slow tier
# (tests/slow.py: more cases of matrices it runs, longer waits for faults it plants), about
# 10 minutes on 2 cores; `make test-slow` runs that tier alone, `make test-all` everything
# (what CI runs, about 20 minutes).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

test-all: $(STAMP)
	$(PYTEST)

# --strict: any warning (a broken link or anchor, a reference entry that does not resolve) fails.
# tests/test_docs.py runs the same build, so `make test-all` checks it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Not part of `make test`: needs root. Installs munge and SLURM (apt) if missing, runs a
# two-node SLURM cluster on 127.0.0.1 and submits examples/slurm_job.sbatch to it.
test-slurm: $(STAMP)
	bash tests/slurm/run.sh

# Lint and the format check over the whole tree (`ruff format .` fixes the latter).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy jaxcoll

# What CI runs (.ci/run): lint, format, types, the strict docs build, then every test.
check: lint typecheck docs test-all

clean:
	rm -rf $(VENV) build site *.egg-info
