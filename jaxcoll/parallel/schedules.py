"""Pipeline schedules as values: :class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved`.

A schedule says how many micro-batches a step's batch is split into and in which order the
stages run their forwards and backwards; :func:`jaxcoll.parallel.pipeline_value_and_grad`
lowers it. Each value answers, before anything is compiled, what the schedule costs: the idle
share of a stage's slots (:meth:`Schedule.bubble_fraction`) and the micro-batch inputs a stage
keeps for its backward (:meth:`Schedule.kept_inputs`, activation memory), as torch's
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` objects are built with
their ``n_microbatches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


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
    """The lowering :func:`~jaxcoll.parallel.pipeline_value_and_grad` runs for it."""

    def __post_init__(self) -> None:
        if type(self) not in SCHEDULES.values():
            raise TypeError(
                f"{type(self).__name__}: not a schedule the pipeline lowers; use "
                f"GPipe(M), OneFOneB(M) or Interleaved(M, virtual=v) (Schedule is their base; "
                f"a new schedule is a subclass here with its own lowering)."
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


SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (GPipe, OneFOneB, Interleaved)}
"""The schedule classes by their former string names (``"gpipe"``, ``"1f1b"``,
``"interleaved"``)."""
