"""Trainer.fit on dp.TokenBatches across processes, each process reading only its own rows.

Usage: ``grain_train.py TOKENS OUT CKPT STEPS KILL_AT`` under ``jaxcoll-run``: trains
token_model's bigram model on the token file TOKENS to step STEPS with
``checkpoint=dp.Checkpointer(CKPT, every=2)`` (resuming from CKPT's newest checkpoint), on
every device of the job (DDP). Each process appends, for every step it takes, the rows of the
global batch its devices hold and their window ids (read from the placed batch) to
``OUT/ids_p{process}_r{restart}.json``; process 0 writes the final params to
``OUT/params.npz``. ``KILL_AT`` > 0: in the job's first run, process 1 SIGKILLs itself when
step KILL_AT completes (``jaxcoll-run --max-restarts 1`` then restarts the job from the
newest checkpoint).
"""

import json
import os
import signal
import sys

import jaxcoll

jaxcoll.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import token_model as tm  # noqa: E402

from jaxcoll import dp  # noqa: E402

TOKENS, OUT, CKPT = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, KILL_AT = int(sys.argv[4]), int(sys.argv[5])
ME = jax.process_index()
RESTART = os.environ.get("JAXCOLL_RESTART_COUNT", "0")
os.makedirs(OUT, exist_ok=True)

trainer = tm.trainer()
data = tm.data(TOKENS, trainer)
assert len(data.rows) == tm.BATCH // jax.process_count()  # this process's share only


def kill(step, metrics):
    if KILL_AT and step == KILL_AT and ME == 1 and RESTART == "0":
        os.kill(os.getpid(), signal.SIGKILL)


state = trainer.init(tm.init_params(), jax.random.key(0))
try:
    state, history = trainer.fit(
        state,
        data,
        steps=STEPS,
        checkpoint=dp.Checkpointer(CKPT, every=2),
        callbacks=[kill],
        progress=False,
    )
finally:  # the ids of every step taken, also in a run that fails
    with open(os.path.join(OUT, f"ids_p{ME}_r{RESTART}.json"), "w") as fh:
        json.dump({s: {str(r): i for r, i in rows.items()} for s, rows in trainer.seen.items()}, fh)
params = trainer.host_params(state)  # collective: every process takes part
if ME == 0:
    np.savez(os.path.join(OUT, "params.npz"), **params)
print(
    f"process {ME}: finished at step {int(jax.device_get(state.step))} on "
    f"{jax.process_count()} x {jax.local_device_count()} devices, rows "
    f"{data.rows[0]}..{data.rows[-1]}, {len(history)} steps in this run",
    flush=True,
)
