"""What a backend hands the sampler: pollers, each reading a few metrics with one or two driver calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# How the sampler treats a failed read: "unsupported" drops that metric for the rest of the run, "lost" drops the
# whole device (group), "error" is counted and the metric is tried again at its next period.
Failure = Literal["unsupported", "lost", "error"]


def count_everything_as_error(exc: BaseException) -> Failure:
    return "error"


@dataclass
class Poller:
    """One read of a group of metrics.

    `read()` returns a list with one value per column, or raises when the read failed as a whole. A `partial`
    poller may instead put an exception instance in place of a value when only that metric failed (NVML field values
    report a status per field); the sampler then sees the failure at once. `period_s` of 0 means every tick.
    `drop(column)` tells the poller to stop asking for a column that failed as unsupported.
    """

    name: str
    group: str
    columns: list[str]
    units: list[str]
    period_s: float
    read: Callable[[], Sequence[Any]]
    classify: Callable[[BaseException], Failure] = count_everything_as_error
    drop: Callable[[str], None] | None = None
    counter_columns: set[str] = field(default_factory=set)  # monotonically increasing (energy): summed as increases
    blocking: bool = False  # a call that can take milliseconds: the sampler runs it off the fast thread
    partial: bool = False  # read() may return an exception in place of a value (see above)

    def __post_init__(self) -> None:
        if len(self.columns) != len(self.units):
            raise ValueError(f"poller {self.name}: {len(self.columns)} columns but {len(self.units)} units")
        if self.period_s < 0:
            raise ValueError(f"poller {self.name}: period_s must be >= 0, got {self.period_s}")

    def failure(self, exc: BaseException) -> Failure:
        """`classify(exc)`, or "error" where classify itself fails (a bug there must not stop the sampler)."""
        try:
            return self.classify(exc)
        except Exception:
            return "error"
