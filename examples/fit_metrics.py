"""Trainer.fit as a real program's loop: named evaluation sets, save-the-best and early
stopping, step metrics (throughput, FLOPs, MFU, learning rate, memory), TensorBoard, a plot
and a profile, on scikit-learn's digits with 8 simulated CPU devices.

    python examples/fit_metrics.py                      # ~20 s on 2 CPU cores
    python examples/fit_metrics.py --images docs/img    # also the pictures of docs/dp.md

Writes under --out (default out/fit_metrics): the best checkpoint (best/), TensorBoard's
event file (tb/; `tensorboard --logdir out/fit_metrics/tb`), the plot (fit_plot.png), the
TensorBoard scalars read back from the event file and drawn (tensorboard_scalars.png), and a
trace of steps 50 to 52 (profile/; TensorBoard's profile plugin or Perfetto) with its
timeline drawn by dp.plot_trace (profile_trace.png).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--out", default="out/fit_metrics")
parser.add_argument("--images", default=None, help="also write the three PNGs here")
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from jaxcoll import dp  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        for width in (256, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, batch):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def draw_scalars(logdir: str, path: str) -> None:
    """The scalars of the event file in ``logdir``, read back, one panel per tag."""
    scalars = dp.read_scalars(logdir)
    tags = ["loss", "eval_val_loss", "eval_val_accuracy", "lr", "examples_per_s", "mfu"]
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.2))
    for ax, tag in zip(axes.flat, tags):
        steps, values = zip(*scalars[tag])
        ax.plot(steps, values, marker="o" if tag.startswith("eval_") else None, ms=3, lw=1)
        ax.set_title(tag, fontsize=10)  # the tag as read from the event file
        ax.grid(alpha=0.3)
        ax.set_xlabel("step", fontsize=8)
    name = os.path.basename(sorted(os.listdir(logdir))[0])
    fig.suptitle(f"TensorBoard scalars read back from {name[:40]}...", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train = dp.Batches({"x": x_tr, "y": y_tr}, 128, seed=0)
    val = dp.Batches({"x": x_va, "y": y_va}, 128)
    train_sample = [{"x": x_tr[:360], "y": y_tr[:360]}]  # the training loss, measured as val's

    model = dp.Linen(MLP(), cross_entropy)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=30, decay_steps=600)
    trainer = dp.Trainer(model, optax.inject_hyperparams(optax.adam)(learning_rate=schedule))
    params, model_state = model.init(jax.random.key(0), train[0])
    state = trainer.init(params, jax.random.key(1), model_state=model_state)

    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    best = dp.SaveBest("eval_val_loss")
    stop = dp.EarlyStopping("eval_val_loss", patience=4)
    state, history = trainer.fit(
        state,
        train,
        steps=args.steps,
        checkpoint=dp.Checkpointer(os.path.join(out, "best"), every=None),
        callbacks=[
            dp.Profile(os.path.join(out, "profile"), steps=(50, 53)),
            dp.Evaluate({"val": val, "train": train_sample}, every=25),
            dp.Throughput(peak_flops="measure"),
            best,
            stop,
            dp.TensorBoardWriter(os.path.join(out, "tb")),
            dp.PlotWriter(os.path.join(out, "fit_plot.png"), title="digits MLP, 8 CPU devices"),
        ],
    )
    last = history[-1]
    print(
        f"ran {last['step']} steps (early stop at {stop.stopped_step}); best val loss "
        f"{best.best:.4f} at step {best.best_step}, saved at steps {best.saved}"
    )
    print(
        f"last step: {last['examples_per_s']:.0f} examples/s, {last['flops_per_step']:.3g} "
        f"FLOPs/step, mfu {last['mfu']:.2%}, lr {last['lr']:.2e}, "
        f"{last['memory_bytes'] / 2**20:.1f} MiB per device"
    )
    draw_scalars(os.path.join(out, "tb"), os.path.join(out, "tensorboard_scalars.png"))
    drawn = dp.plot_trace(os.path.join(out, "profile"), os.path.join(out, "profile_trace.png"))
    print(f"profile of steps 50-52: {drawn['span_s'] * 1e3:.0f} ms, top {drawn['ops'][:3]}")
    if args.images:
        os.makedirs(args.images, exist_ok=True)
        for name in ("fit_plot.png", "tensorboard_scalars.png", "profile_trace.png"):
            shutil.copy(os.path.join(out, name), os.path.join(args.images, name))
    print(
        f"wrote {out}/fit_plot.png, {out}/tensorboard_scalars.png, {out}/profile_trace.png, "
        f"tb/, best/, profile/"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
