"""Pipeline schedules as values: :class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved`,
:class:`ZeroBubble`.

A schedule says how many micro-batches a step's batch is split into and in which order the
stages run their forwards and backwards; :func:`jaxcoll.parallel.pipeline_value_and_grad` and
:func:`jaxcoll.parallel.pipeline_loss` lower it. Each value answers, before anything is
compiled, what the schedule costs: the idle share of a stage's slots
(:meth:`Schedule.bubble_fraction`) and the micro-batch inputs a stage keeps for its backward
(:meth:`Schedule.kept_inputs`, activation memory), as torch's ``ScheduleGPipe`` /
``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` objects are built with their
``n_microbatches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .._core import roles


def _positive_int(owner: str, name: str, value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int ({what}), got {value!r} instead.")
    if value < 1:
        raise ValueError(f"{owner}: {name}={value} must be a positive int ({what}).")
    return value


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule of ``microbatches`` micro-batches per step (see the subclasses)."""

    microbatches: int
    """M: the micro-batches a step's batch (each data replica's part) is split into."""

    name: ClassVar[str] = ""
    """Its short name (``"1f1b"``): its key in :data:`SCHEDULES`."""

    def __post_init__(self) -> None:
        if type(self) not in SCHEDULES.values():
            raise TypeError(
                f"{type(self).__name__}: not a schedule the pipeline lowers; use GPipe(M), "
                f"OneFOneB(M), Interleaved(M, virtual=v) or ZeroBubble(M) (Schedule is their "
                f"base; a new schedule is a subclass here with its own lowering)."
            )
        _positive_int(
            type(self).__name__, "microbatches", self.microbatches, "micro-batches per step"
        )

    @property
    def virtual(self) -> int:
        """v: model chunks per stage (1 but for :class:`Interleaved`)."""
        return 1

    def check(self, api: str, stages: int) -> None:
        """Raise ValueError, naming ``api``, if this schedule cannot run on ``stages``."""
        _positive_int(api, "stages", stages, "the size of the stage axis")

    def bubble_fraction(self, stages: int) -> float:
        """The idle share of a stage's slots on ``stages`` stages, as lowered here.

        A slot is one forward or one backward of one stage's model chunk (the whole stage but
        for :class:`Interleaved`). Every stage is busy for ``2Mv`` of ``2(Mv + S - 1)``
        slots, so the bubble is ``(S - 1) / (vM + S - 1)``: the same ``(S - 1) / (M + S - 1)``
        for GPipe and 1F1B (1F1B bounds memory, not the bubble), about v times smaller
        interleaved.

        Example::

            >>> OneFOneB(8).bubble_fraction(4)
            0.2727272727272727
            >>> Interleaved(8, virtual=2).bubble_fraction(4)
            0.15789473684210525
        """
        self.check(f"{self!r}.bubble_fraction", stages)
        m, v = self.microbatches, self.virtual
        return (stages - 1) / (m * v + stages - 1)

    def kept_inputs(self, stages: int) -> int:
        """The most micro-batch inputs (of one model chunk) a stage holds at once for its
        backwards: the schedule's activation memory, in units of one micro-batch's input to
        one chunk."""
        raise NotImplementedError


@dataclass(frozen=True)
class GPipe(Schedule):
    """GPipe: every micro-batch's forward (stage s runs micro-batch t - s at step t), then
    every backward in reverse. Each stage keeps all M micro-batches' inputs."""

    name: ClassVar[str] = "gpipe"

    def kept_inputs(self, stages: int) -> int:
        self.check(f"{self!r}.kept_inputs", stages)
        return self.microbatches


@dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B (one forward, one backward; PipeDream-flush, Megatron's non-interleaved
    schedule): after a warm-up, each stage alternates a forward and a backward, so it keeps
    at most ``min(S, M)`` micro-batches' inputs instead of GPipe's M, for the same bubble."""

    name: ClassVar[str] = "1f1b"

    def kept_inputs(self, stages: int) -> int:
        self.check(f"{self!r}.kept_inputs", stages)
        return min(stages, self.microbatches)


@dataclass(frozen=True)
class Interleaved(Schedule):
    """Megatron's interleaved 1F1B: each stage holds ``virtual`` model chunks (chunks s,
    s + S, ..., of a model of S * virtual chunks) and runs the micro-batches in groups of one
    per stage, which divides the bubble by about ``virtual`` for ``virtual`` times the
    transfers. M must be a multiple of the number of stages."""

    virtual: int = 2
    """v: model chunks per stage."""

    name: ClassVar[str] = "interleaved"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("Interleaved", "virtual", self.virtual, "model chunks per stage")

    def check(self, api: str, stages: int) -> None:
        super().check(api, stages)
        if self.virtual > 1 and self.microbatches % stages:
            raise ValueError(
                f"{api}: {self!r} runs the micro-batches in groups of one per stage, so "
                f"microbatches={self.microbatches} must be a multiple of the {stages} stages "
                f"(Megatron's rule); pass Interleaved({-(-self.microbatches // stages) * stages}"
                f", virtual={self.virtual}) or another multiple of {stages}."
            )

    def kept_inputs(self, stages: int) -> int:
        self.check(f"{self!r}.kept_inputs", stages)
        m, v = self.microbatches, self.virtual
        return min(m * v, v * stages + stages - 1)


@dataclass(frozen=True)
class ZeroBubble(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): each backward split into
    B, the input's gradient (the next stage down waits for it), and W, the params' gradient
    (nobody waits for it), and W's postponed into what would be 1F1B's bubble. Stage s runs
    S - s - 1 warm-up forwards, then s pairs of F and B (their W's deferred), then F, B, W
    while forwards remain, then B, W, then the deferred W's: a stage holds at most S stage
    inputs, as 1F1B's first stage does.

    In units of one forward (a B and a W each as long), a step takes ``3M + S - 1`` units of
    which each stage idles ``S - 1``, a third of 1F1B's ``3(S - 1)`` (whose backward is B and W
    at once). :meth:`table` is the schedule, slot by slot, as lowered."""

    name: ClassVar[str] = "zb"

    def order(self, stages: int, s: int) -> list[tuple[str, int]]:
        """Stage ``s``'s operations in order: ``("F" | "B" | "W", micro-batch)``."""
        m = self.microbatches
        ops: list[tuple[str, int]] = []
        f = b = w = 0
        for _ in range(min(stages - s - 1, m)):
            ops.append(("F", f))
            f += 1
        for _ in range(s):
            if f < m:
                ops += [("F", f), ("B", b)]
                f, b = f + 1, b + 1
        while f < m:
            ops += [("F", f), ("B", b), ("W", w)]
            f, b, w = f + 1, b + 1, w + 1
        while b < m:
            ops += [("B", b), ("W", w)]
            b, w = b + 1, w + 1
        ops += [("W", k) for k in range(w, m)]
        return ops

    def table(self, stages: int) -> list[list[tuple[str, int] | None]]:
        """Each stage's operation in each slot (None: idle), every stage running its
        :meth:`order` as soon as what it needs has arrived: a forward the previous stage's
        output of the slot before, a backward its own forward and the next stage's B of the
        slot before (the last stage: its own forward)."""
        self.check(f"{self!r}.table", stages)
        orders = [self.order(stages, s) for s in range(stages)]
        at = [0] * stages
        done: list[dict[tuple[str, int], int]] = [{} for _ in range(stages)]
        rows: list[list[tuple[str, int] | None]] = [[] for _ in range(stages)]
        t = 0
        while any(at[s] < len(orders[s]) for s in range(stages)):
            now: list[tuple[str, int] | None] = []
            for s in range(stages):
                op = orders[s][at[s]] if at[s] < len(orders[s]) else None
                if op is not None:
                    kind, k = op
                    if kind == "F" and s > 0:
                        ready = done[s - 1].get(("F", k), t) < t
                    elif kind == "B":
                        ready = ("F", k) in done[s] and (
                            s == stages - 1 or done[s + 1].get(("B", k), t) < t
                        )
                    else:
                        ready = True
                    op = op if ready else None
                now.append(op)
            for s, op in enumerate(now):
                rows[s].append(op)
                if op is not None:
                    done[s][op] = t
                    at[s] += 1
            t += 1
        return rows

    def bubble_fraction(self, stages: int) -> float:
        """The idle share of a stage's slots in :meth:`table` (slots of one F, B or W):
        ``(S - 1) / (3M + S - 1)``.

        Example::

            >>> ZeroBubble(8).bubble_fraction(4)
            0.1111111111111111
        """
        rows = self.table(stages)
        return sum(op is None for op in rows[0]) / len(rows[0])

    def kept_inputs(self, stages: int) -> int:
        """The most stage inputs a stage holds at once, from their arrival to their W (B
        recomputes the forward from them; what W needs, B saves): the lowering's buffers."""
        rows = self.table(stages)
        most = 1
        for s, row in enumerate(rows):
            live = 0
            for t, op in enumerate(row):
                # Stage 0's input is there when its forward runs; a later stage's arrives
                # the slot after the previous stage's forward.
                before = rows[s - 1][t - 1] if s > 0 and t > 0 else None
                arrived = (
                    (op is not None and op[0] == "F")
                    if s == 0
                    else (before is not None and before[0] == "F")
                )
                live += int(arrived)
                most = max(most, live)
                live -= int(op is not None and op[0] == "W")
        return most


SCHEDULES: dict[str, type[Schedule]] = {
    s.name: s for s in (GPipe, OneFOneB, Interleaved, ZeroBubble)
}
"""The schedule classes by their short names (``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
``"zb"``), the one table of them. A name is not a schedule: ``schedule="1f1b"`` is refused,
naming the value to pass."""

roles.SCHEDULES.update(SCHEDULES)  # where dp.Layout.parse reads them (dp may not import parallel)
