"""Test setup: 8 simulated CPU devices, set once before JAX touches a device."""

import os

import pytest

from jaxcoll._xla_flags import with_xla_cpu_flags  # imports nothing
from tests.compile_flags import with_fast_compile  # imports nothing
from tests.slow import is_slow  # imports nothing

# 8 devices, and XLA:CPU's rendezvous timeouts out of the way: on a loaded machine a device
# thread can join a collective 40 s late, and XLA:CPU would then abort the whole test process.
# And XLA:CPU compiling fast (tests/compile_flags.py).
os.environ["XLA_FLAGS"] = with_fast_compile(
    with_xla_cpu_flags(os.environ.get("XLA_FLAGS", ""), devices=8)
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(items):
    """Mark the slow tier (tests/slow.py): ``make test`` runs ``-m "not slow"``."""
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
