"""The checkpoint calls' meeting point: every process of a job makes the same save or restore
call at the same point, or each raises, naming the process that did not (saving and restoring
are collective; orbax alone would wait on a missing peer until a library timeout aborts)."""

from __future__ import annotations

import itertools
import time

from ..._watch import process

# The n-th save or restore of this process: every process of a job makes the same calls in
# the same order, so the n-th meets the others' n-th.
_calls = itertools.count(1)


def rendezvous(api: str, what: str, directory: str, timeout: float, *, fix: str) -> int:
    """Meet every other process of the job at this call, or raise RuntimeError.

    Each process writes ``what`` (e.g. ``save step 10``) under the number of its calls so far
    in ``jax.distributed``'s key-value store and waits for every other process's entry of the
    same number: up to ``timeout`` seconds, less when a peer exits or fails first. Raises,
    naming ``api``, the processes and ``fix``, when one does not come or makes another call
    (a save of another step, a restore). Nothing to do in a single process. Returns the
    number of the call (the same on every process).
    """
    client = process.client()
    me, n = process.me()
    seq = next(_calls)
    if client is None or n < 2:
        return seq
    key = f"{process.PREFIX}ckpt/{seq}/"
    client.key_value_set(key + str(me), what)
    deadline = time.monotonic() + timeout
    got = {me: what}
    for p in range(n):
        while p not in got:
            try:
                got[p] = str(client.blocking_key_value_get(key + str(p), 500))
                continue
            except Exception:  # noqa: BLE001 - not there yet
                pass
            gone = p in process.exited() or p in process.failed()
            if gone or time.monotonic() > deadline:
                why = "ended" if gone else f"did not call it within {timeout:g}s"
                raise RuntimeError(
                    f"{api}: process {me} is at {what} ({directory}), but process {p} {why}. "
                    f"Saving and restoring are collective in a multi-process job: every "
                    f"process must make the same call at the same point, as Trainer.fit "
                    f"does (each process writes or reads its own shards; orbax coordinates "
                    f"them), so a save on one process only cannot work. Fix: {fix}. If the "
                    f"processes do reach it but further apart, raise "
                    f"dp.Checkpointer(..., rendezvous_timeout=) (now {timeout:g}s)."
                )
    if len(set(got.values())) > 1:
        listing = "; ".join(f"process {p}: {got[p]}" for p in sorted(got))
        raise RuntimeError(
            f"{api}: the processes make different checkpoint calls at the same point "
            f"({listing}). Saving and restoring are collective: every process must save the "
            f"same step (or restore) together, as Trainer.fit does. Fix: {fix}."
        )
    return seq
