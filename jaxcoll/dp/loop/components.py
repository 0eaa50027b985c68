"""Components: callbacks that take part in :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>`'s loop
(CLU's periodic actions, torchtitan's components), passed in ``callbacks=`` like any other.

* :class:`~jaxcoll.dp.Evaluate` (in :mod:`jaxcoll.dp.loop.evaluate`): evaluation every k steps;
* :class:`Throughput`: ``tokens_per_s`` and ``mfu`` in every step's metrics;
* :class:`Profile`: a ``jax.profiler`` trace of a window of steps;
* :class:`Progress`: the tqdm bar (``fit(progress=...)``).

A :class:`Component` is a :class:`~jaxcoll.dp.Callback` with hooks into the loop, each given
the :class:`Loop` (the state, the trainer, a way to wait for the steps in flight): ``fit``
calls them in the order of ``callbacks=``. The hooks are for jaxcoll's components; their
shape may change between releases.
"""

from __future__ import annotations

import numbers
import os
import sys
from collections.abc import Iterable
from typing import Any, Protocol

import jax

from ..._core.typing import PyTree
from ..callbacks.base import Callback
from ..checkpoint.checkpointer import check_directory
from ..data.batches import Batches
from ..reports.metrics import check_peak_flops, measure_peak_flops
from ..state import TrainState
from .args import count, positive


class Steps(Protocol):
    """What :meth:`Trainer.fit` uses of a :class:`~jaxcoll.dp.Trainer`."""

    def step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]: ...

    def shard_batch(self, batch: PyTree) -> PyTree: ...

    def evaluate(self, state: TrainState, data: Batches | Iterable[PyTree]) -> dict[str, float]: ...


class Loop(Protocol):
    """What a component sees of one call of ``fit``.

    ``state`` is the newest state (after ``step`` updates); after :meth:`settle` every step
    dispatched has been reported, so it is the state a checkpoint or an evaluation at
    ``step`` sees. ``start`` and ``total`` are ``state.step`` at the start and the step
    count ``fit`` runs to; ``devices`` the device count of the trainer's mesh."""

    trainer: Steps
    state: TrainState
    step: int
    start: int
    total: int
    devices: int

    def settle(self) -> None:
        """Wait for the steps in flight and report them (``on_step``)."""

    def report_eval(self, step: int, results: dict[str, float]) -> None:
        """Put evaluation results into the history (``eval_`` keys) and give them to every
        callback's ``on_eval``; what those ask is done after the hook returns."""

    def restart_clock(self) -> None:
        """Start the next step's time now: the hook's own work is not the step's."""


class Component(Callback):
    """A :class:`~jaxcoll.dp.Callback` with hooks into ``fit``'s loop; the defaults do
    nothing. In order, for one call of ``fit``:

    * ``on_fit_start(loop)``: after the checkpoint is restored, before the first batch is built;
    * ``before_step(loop, step)`` / ``after_step(loop, step)``: around the dispatch of step
      ``step`` (``state.step`` after it); after it, the step before is reported, the step
      itself may still be in flight (``loop.settle()`` waits for it);
    * ``add_metrics(step, metrics, examples)``: when step ``step``'s outputs are read, before
      any ``on_step``: add keys to ``metrics`` (``examples``: the global batch size);
    * ``after_last_step(loop, step)``: after the last step is reported, before the final save;
    * ``close()``: always, last (also when ``fit`` raises).
    """

    def on_fit_start(self, loop: Loop) -> None:
        """After the restore, before the first batch."""

    def before_step(self, loop: Loop, step: int) -> None:
        """Before step ``step`` is dispatched."""

    def after_step(self, loop: Loop, step: int) -> None:
        """After step ``step`` is dispatched (and the step before it reported)."""

    def add_metrics(self, step: int, metrics: dict[str, float], examples: int) -> None:
        """Add to step ``step``'s metrics before the callbacks see them."""

    def after_last_step(self, loop: Loop, step: int) -> None:
        """After the last step (``step``) is reported, before the final save and ``on_end``."""

    def close(self) -> None:
        """Release what the component holds; called even when ``fit`` raises."""


class Throughput(Component):
    """Throughput and MFU in every step's metrics: torchtitan's tokens/s and MFU.

    Adds ``tokens_per_s`` (``examples_per_s * tokens_per_example``) and ``mfu``
    (``flops_per_step / step_time_s / (peak_flops * n_devices)``, where the step's FLOPs are
    known) to the step metrics that ``fit`` measures anyway (:mod:`jaxcoll.dp.reports.metrics`).

    Args:
        tokens_per_example: tokens in one example (a sequence's length): adds
            ``tokens_per_s``.
        peak_flops: one device's peak FLOP/s, for ``mfu``; ``"measure"``:
            :func:`~jaxcoll.dp.measure_peak_flops` once at the start of each ``fit`` (printed,
            and kept as ``peak_flops`` in its first step's metrics); None: no ``mfu``.

    Example::

        >>> trainer.fit(state, data, steps=100,
        ...             callbacks=[dp.Throughput(tokens_per_example=256, peak_flops="measure")])
    """

    def __init__(
        self, tokens_per_example: int | None = None, peak_flops: float | str | None = None
    ) -> None:
        api = "dp.Throughput"
        if tokens_per_example is None and peak_flops is None:
            raise ValueError(
                f"{api}: pass tokens_per_example= (for tokens_per_s) and/or peak_flops= (for "
                f"mfu); with neither it adds nothing (examples_per_s and flops_per_step are "
                f"always in the step metrics)."
            )
        self.tokens_per_example = positive(
            api,
            "tokens_per_example",
            tokens_per_example,
            "int (the tokens of one example, e.g. the sequence length)",
        )
        self.peak_flops = check_peak_flops(api, peak_flops)
        self.peak: float | None = None
        self.measured: float | None = None  # kept in the first step's metrics, then None
        self.devices = 1

    def on_fit_start(self, loop: Loop) -> None:
        self.devices = loop.devices
        self.measured = None
        if self.peak_flops == "measure":
            self.peak = self.measured = measure_peak_flops()
            if jax.process_index() == 0:
                print(
                    f"Trainer.fit: measured peak {self.measured:.4g} FLOP/s per device "
                    f"(dp.measure_peak_flops() on {jax.local_devices()[0]}); mfu is against it.",
                    file=sys.stderr,
                    flush=True,
                )
        else:
            assert self.peak_flops is None or isinstance(self.peak_flops, float)
            self.peak = self.peak_flops

    def add_metrics(self, step: int, metrics: dict[str, float], examples: int) -> None:
        dt = metrics["step_time_s"]
        if self.tokens_per_example is not None:
            metrics["tokens_per_s"] = examples * self.tokens_per_example / dt
        flops = metrics.get("flops_per_step")
        if flops is not None and self.peak is not None:
            metrics["mfu"] = flops / dt / (self.peak * self.devices)
        if self.measured is not None:
            metrics["peak_flops"] = self.measured
            self.measured = None


class Profile(Component):
    """Trace a window of steps with ``jax.profiler``, for TensorBoard's profile plugin or
    Perfetto (:func:`~jaxcoll.dp.plot_trace` draws its timeline).

    The trace starts before step ``start`` is dispatched and stops once step ``stop - 1``
    has finished (the loop waits for it: the trace holds the profiled steps whole). It holds
    the runtime's and the devices' events, not the Python tracer's function calls
    (``python_tracer_level=0``): those hooks, on every thread of the process, made
    ``stop_trace`` end the process with a fatal error now and then.

    Args:
        directory: where the trace goes (created if missing).
        steps: ``(start, stop)``: steps ``start`` to ``stop - 1``, numbered as callbacks see
            them (1 is the first step, which compiles: ``(2, 5)`` skips it).

    Example::

        >>> trainer.fit(state, data, steps=20, callbacks=[dp.Profile("prof", steps=(10, 13))])
    """

    def __init__(self, directory: str | os.PathLike, steps: tuple[int, int]) -> None:
        api = "dp.Profile"
        ok = (
            isinstance(steps, (tuple, list))
            and len(steps) == 2
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in steps)
        )
        if not ok:
            raise TypeError(
                f"{api}: steps must be a pair of ints (start, stop): the steps start to stop - 1 "
                f"are traced, numbered as callbacks see them (1 is the first); got {steps!r}."
            )
        self.begin, self.stop = int(steps[0]), int(steps[1])
        if not 1 <= self.begin < self.stop:
            raise ValueError(
                f"{api}: steps={steps!r} must have 1 <= start < stop (the steps start to stop - "
                f"1 are traced; 1 is the first step, which compiles: (2, 5) skips it)."
            )
        self.directory = check_directory(api, "directory", directory)
        self.tracing = False

    def before_step(self, loop: Loop, step: int) -> None:
        if not self.tracing and self.begin <= step < self.stop:
            # Without the Python tracer: it hooks every thread of the process (the loop's,
            # a TensorBoard writer's, the watchdog's), and its stop_trace ended the process
            # with a fatal error now and then; the device and runtime events are all traced.
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.directory, profiler_options=options)
            self.tracing = True

    def after_step(self, loop: Loop, step: int) -> None:
        if self.tracing and step >= self.stop - 1:
            loop.settle()  # the trace holds the profiled steps whole
            self.close()
            loop.restart_clock()

    def after_last_step(self, loop: Loop, step: int) -> None:
        self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class Progress(Component):
    """A tqdm bar of the steps, with the loss every ``every`` steps (and at the last).

    ``fit(progress=None)`` (the default) shows one only when stderr is a terminal;
    ``progress=True`` always, ``progress=dp.Progress(every=50)`` with its own interval.

    Args:
        every: steps between updates of the bar's loss.
    """

    def __init__(self, every: int = 10) -> None:
        self.every = count(
            "dp.Progress", "every", every, "number of steps (between updates of the bar's loss)"
        )
        self.bar: Any = None
        self.total = 0

    def on_fit_start(self, loop: Loop) -> None:
        from tqdm.auto import tqdm  # imported when a bar is shown

        self.close()
        self.total = loop.total
        self.bar = tqdm(total=loop.total, initial=loop.start, unit="step", dynamic_ncols=True)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if step % self.every == 0 or step == self.total:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
