"""tests/multihost/workers/replica_loss.py under ``jaxcoll-run --recoverable``.

Usage: ``run_recoverable.py OUT KILL_STEP STEPS VICTIM REPLICATE SHARD [MODE]``, every process
started by the launcher. The same worker (HSDP ``dp.Survivor``, process VICTIM SIGKILLs
itself at step KILL_STEP), except that a process the launcher started as a replacement
(``--replace``: ``JAXCOLL_REPLACEMENT=1``) runs in mode ``replacement`` (``Survivor.join``),
and MODE ``pause`` (``make test-slurm``'s job (g)): the victim, instead of killing itself,
writes ``OUT/killed`` and sleeps, for the test to take its node away.
"""

import os
import runpy
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:8]
if os.environ.get("JAXCOLL_REPLACEMENT") == "1":
    args = [*args[:6], "replacement"]
elif args[6:] == ["pause"]:
    args = args[:6]  # replica_loss.py's "loss" mode, its victim's SIGKILL made a sleep
    kill = os.kill

    def sleep_instead(pid: int, sig: int) -> None:
        if pid != os.getpid() or sig != signal.SIGKILL:
            kill(pid, sig)
            return
        while True:  # until the node (this process with it) is taken away
            time.sleep(1.0)

    os.kill = sleep_instead
sys.argv = [os.path.join(HERE, "replica_loss.py"), *args]
runpy.run_path(sys.argv[0], run_name="__main__")
