"""The checkpoint calls' meeting point: every process of a job makes the same save or restore
call at the same point, or each raises, naming the process that did not (saving and restoring
are collective; orbax alone would wait on a missing peer until a library timeout aborts)."""

from __future__ import annotations

import itertools

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

    def missing(p: int, why: str) -> Exception:
        return RuntimeError(
            f"{api}: process {me} is at {what} ({directory}), but process {p} {why}. "
            f"Saving and restoring are collective in a multi-process job: every "
            f"process must make the same call at the same point, as Trainer.fit "
            f"does (each process writes or reads its own shards; orbax coordinates "
            f"them), so a save on one process only cannot work. Fix: {fix}. If the "
            f"processes do reach it but further apart, raise "
            f"dp.Checkpointer(..., rendezvous_timeout=) (now {timeout:g}s)."
        )

    got = process.exchange(key, what, range(n), timeout, missing)
    if len(set(got.values())) > 1:
        listing = "; ".join(f"process {p}: {got[p]}" for p in sorted(got))
        raise RuntimeError(
            f"{api}: the processes make different checkpoint calls at the same point "
            f"({listing}). Saving and restoring are collective: every process must save the "
            f"same step (or restore) together, as Trainer.fit does. Fix: {fix}."
        )
    return seq
