"""`make demo`: run the seed examples (each rank's values before and after), then the main job.

Run:  python examples/run_all.py
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED_EXAMPLES = sorted(p for p in HERE.glob("0[0-9]_*.py"))
MAIN_JOB = HERE / "train_digits.py"


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each script sets its own
    scripts = SEED_EXAMPLES + ([MAIN_JOB] if MAIN_JOB.exists() else [])
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        code = subprocess.call([sys.executable, str(script)], env=env)
        if code:
            print(f"{script.name} failed with exit code {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
