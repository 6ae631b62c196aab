"""Streaming statistics and the run summary: the same code serves the live sampler and `gpumon summary FILE`.

Memory stays bounded: each metric keeps O(1) running values plus a uniform reservoir of at most
RESERVOIR_SIZE readings for the percentiles, which are exact until a metric has more readings than that
(about 10 minutes at 100 Hz) and a uniform-sample estimate after (the summary says which).
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

RESERVOIR_SIZE = 65536


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): percentile([1, 2, 3, 4], 50) == 2.5."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Reservoir:
    """Uniform sample of at most `capacity` values, seeded for reproducible summaries.

    Once full, the gap to the next value that replaces one is drawn directly (Li's algorithm L, ACM TOMS 20(4),
    1994) rather than a random number per value as in algorithm R: a value that is not taken, or a whole run of
    equal values (a metric read again unchanged), costs a comparison.
    """

    __slots__ = ("values", "seen", "capacity", "_rng", "_log_w", "_next")

    def __init__(self, capacity: int = RESERVOIR_SIZE) -> None:
        self.values = array("d")
        self.seen = 0
        self.capacity = capacity
        self._rng = random.Random(0)
        self._log_w = 0.0  # log of algorithm L's W, kept in logs so that W never rounds to 1
        self._next = 0  # the 1-based position of the next value to take once full

    def add(self, v: float) -> None:
        self.seen += 1
        if self.seen <= self.capacity:
            self.values.append(v)
            if self.seen == self.capacity:
                self._start()
        elif self.seen == self._next:
            self._take(v)

    def add_many(self, v: float, count: int) -> None:
        """`count` values equal to `v`, as if added one by one."""
        free = self.capacity - self.seen
        if free > 0:
            taken = min(count, free)
            self.values.extend(array("d", (v,)) * taken)
            self.seen += taken
            count -= taken
            if self.seen < self.capacity:
                return
            self._start()  # just filled
        end = self.seen + count
        while self._next <= end:
            self._take(v)
        self.seen = end

    def _start(self) -> None:
        # just filled: draw W and the position of the first value to take
        self._log_w = self._log_u() / self.capacity
        self._next = self.seen + self._gap()

    def _take(self, v: float) -> None:
        # the value at position _next replaces a random one; draw the next position
        self.values[self._rng.randrange(self.capacity)] = v
        self._log_w += self._log_u() / self.capacity
        self._next += self._gap()

    def _log_u(self) -> float:
        return math.log(max(self._rng.random(), 1e-300))  # log of a uniform (0, 1) draw

    def _gap(self) -> int:
        # values skipped before the next one is taken, plus one: floor(log(u) / log(1 - W)) + 1
        return math.floor(self._log_u() / math.log(-math.expm1(self._log_w))) + 1

    @property
    def exact(self) -> bool:
        return self.seen <= self.capacity

    def percentiles(self, qs: tuple[float, ...]) -> list[float]:
        ordered = sorted(self.values)
        return [percentile(ordered, q) for q in qs]


class MetricStats:
    """Running statistics of one metric: reads, fresh reads, peak, time-weighted mean, counter increase."""

    __slots__ = (
        "unit",
        "counter",
        "reads",
        "fresh",
        "errors",
        "peak",
        "peak_t",
        "low",
        "first_t",
        "prev_t",
        "prev_v",
        "weighted",
        "span",
        "increase",
        "reservoir",
        "last",
        "tail_t",
        "repeats",
    )

    def __init__(self, unit: str, counter: bool = False, capacity: int = RESERVOIR_SIZE) -> None:
        self.unit, self.counter = unit, counter
        self.reads = self.fresh = self.errors = 0
        self.last: Any = None  # the last reading, numeric or not
        self.peak: float | None = None
        self.low: float | None = None
        self.peak_t: float | None = None
        self.first_t: float | None = None
        self.prev_t: float | None = None  # time of the last numeric reading, None before the first
        self.prev_v = 0.0  # its value: read only once prev_t is set
        self.weighted = self.span = self.increase = 0.0
        self.tail_t = -math.inf
        self.reservoir = Reservoir(capacity)
        self.repeats = 0  # stale readings of prev_v not yet in the reservoir

    def add(self, t: float, v: Any, fresh: bool) -> None:
        if self.repeats:
            self.settle()
        self.reads += 1
        self.fresh += fresh
        self.last = v
        if not isinstance(v, (int, float)):
            return
        if self.prev_t is None:
            self.first_t = t
        else:
            # zero-order hold: a reading stands until the next reading of the same metric
            self.weighted += self.prev_v * (t - self.prev_t)
            self.span += t - self.prev_t
            if self.counter:
                # a counter that went down was reset (driver reload): count what it accumulated since
                self.increase += v - self.prev_v if v >= self.prev_v else v
        if self.peak is None or v > self.peak:
            self.peak, self.peak_t = v, t
        if self.low is None or v < self.low:
            self.low = v
        self.prev_t, self.prev_v = t, v
        self.reservoir.add(float(v))

    def add_stale(self, t: float, v: Any) -> None:
        """The same value (`v`, equal to the last one added) read again: counted now, put into the reservoir and
        the integral at the next add() or settle(), all repeats at once."""
        self.reads += 1
        self.tail_t = t
        if self.prev_t is not None:
            self.repeats += 1

    def settle(self) -> None:
        """Put the pending repeats of the held value into the reservoir (before reading percentiles)."""
        if self.repeats:
            self.reservoir.add_many(float(self.prev_v), self.repeats)
            self.repeats = 0

    def integral(self) -> tuple[float, float]:
        """(integral of the held value over time, time covered), up to the last reading, stale ones included."""
        if self.prev_t is None or self.tail_t <= self.prev_t:
            return self.weighted, self.span
        return self.weighted + self.prev_v * (self.tail_t - self.prev_t), self.span + self.tail_t - self.prev_t

    def as_dict(self) -> dict[str, Any]:
        self.settle()
        out: dict[str, Any] = {"unit": self.unit, "reads": self.reads, "errors": self.errors, "last": self.last}
        out["fresh_fraction"] = self.fresh / self.reads if self.reads else None
        if self.peak is None:
            return out
        p50, p95, p99 = self.reservoir.percentiles((50, 95, 99))
        weighted, span = self.integral()
        mean = weighted / span if span > 0 else float(self.prev_v)
        out.update(peak=self.peak, peak_t=self.peak_t, min=self.low, mean=mean, p50=p50, p95=p95, p99=p99)
        if self.counter:
            out["increase"] = self.increase
        return out


@dataclass
class Summary:
    """What a run looked like. `str(summary)` is a table; `to_dict()` is JSON-able (native units, see `unit`).

    Example (a sampler fed three ticks by hand; `Monitor.summary()` gives the same object):
        >>> from gpumon.pollers import Poller
        >>> from gpumon.sampler import Sampler
        >>> readings = iter([[2**30], [3 * 2**30], [2 * 2**30]])  # memory used at three ticks, in bytes
        >>> memory = Poller("gpu0.memory", "gpu0", ["gpu0.memory_used_bytes"], ["B"], 0.0, lambda: next(readings))
        >>> sampler = Sampler([memory], rate_hz=100)
        >>> for t in (0.0, 0.01, 0.02):
        ...     sampler.sample_once(t)
        >>> s = sampler.summary()
        >>> s.samples, s.achieved_rate_hz, s.metrics["gpu0.memory_used_bytes"]["peak"] / 2**30
        (3, 100.0, 3.0)
        >>> print(s)  # doctest: +ELLIPSIS
        gpumon: 0.02 s, 3 samples, achieved 100.0 Hz (target 100), p99 interval error 0.000 ms, 0 missed ticks
        sampler cost: ...
        metric                  unit  peak  mean  p50  p95   p99  last  fresh  errors
        gpu0.memory_used_bytes  GiB      3     2    2  2.9  2.98     2   100%       0
    """

    rate_hz: float
    duration_s: float
    samples: int
    achieved_rate_hz: float | None
    interval_error_p99_ms: float | None
    missed_ticks: int
    sampler_us_per_sample: float | None
    sampler_cpu_percent: float | None
    percentiles_exact: bool
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    energy_j: dict[str, float] = field(default_factory=dict)
    energy_from_power_j: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    marks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        from gpumon.reports import render_summary

        return render_summary(self)


class SummaryBuilder:
    """Feeds on ticks, readings, errors and marks; `finish()` gives the Summary."""

    def __init__(self, rate_hz: float, units: dict[str, str], counters: set[str], capacity: int = RESERVOIR_SIZE):
        self.rate_hz = rate_hz
        self.period = 1.0 / rate_hz
        self.metrics = {c: MetricStats(u, c in counters, capacity) for c, u in units.items()}
        self.ticks = 0
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.segments = 1  # runs in the file: the time between two runs is neither sampled nor missed
        self._closed_span = 0.0  # sampled time of the runs before the current one
        self._segment_t: float | None = None  # first tick of the current run
        self.interval_errors = Reservoir(capacity)
        self.missed = 0
        self.errors: dict[str, int] = {}
        self.lost: list[str] = []
        self.unsupported: list[str] = []
        self.marks = 0

    def add_tick(self, t: float) -> None:
        if self._segment_t is None:
            self._segment_t = t
            if self.first_t is None:
                self.first_t = t
        elif self.last_t is not None:
            gap = t - self.last_t
            self.interval_errors.add(abs(gap - self.period))
            steps = gap / self.period
            if math.isfinite(steps):  # a damaged file may hold any time at all
                self.missed += max(0, round(steps) - 1)
        self.last_t = t
        self.ticks += 1

    def add_segment(self) -> None:
        """A later run appended to the same file starts: the gap before it is not an interval between ticks."""
        if self._segment_t is not None and self.last_t is not None:
            self._closed_span += self.last_t - self._segment_t
            self._segment_t = None
            self.segments += 1

    @property
    def duration_s(self) -> float:
        """Sampled time: from the first to the last tick of each run, summed over the runs."""
        if self._segment_t is None or self.last_t is None:
            return self._closed_span
        return self._closed_span + self.last_t - self._segment_t

    def add_error(self, column: str, message: str, failure: str) -> None:
        key = f"{column}: {message}"
        self.errors[key] = self.errors.get(key, 0) + 1
        if column in self.metrics:
            self.metrics[column].errors += 1
        if failure == "unsupported" and column not in self.unsupported:
            self.unsupported.append(column)
        if failure == "lost":
            group = column.split(".", 1)[0]
            if group not in self.lost:
                self.lost.append(group)

    def finish(self, busy_s: float | None = None, cpu_s: float | None = None) -> Summary:
        for m in self.metrics.values():
            m.settle()
        duration = self.duration_s
        metrics = {c: m.as_dict() for c, m in self.metrics.items() if m.reads or m.errors}
        energy, from_power = {}, {}
        for c, m in self.metrics.items():
            group = c.split(".", 1)[0]
            if m.counter and m.unit == "mJ" and m.reads >= 2:
                energy[group] = m.increase / 1000.0
            weighted, span = m.integral()
            if c.endswith(".power_instant_mw") and span > 0:
                from_power[group] = weighted / 1000.0
        (p99,) = self.interval_errors.percentiles((99,)) if self.ticks > 1 else (None,)
        return Summary(
            rate_hz=self.rate_hz,
            duration_s=duration,
            samples=self.ticks,
            achieved_rate_hz=(self.ticks - self.segments) / duration if duration > 0 else None,
            interval_error_p99_ms=None if p99 is None else p99 * 1e3,
            missed_ticks=self.missed,
            sampler_us_per_sample=busy_s / self.ticks * 1e6 if busy_s is not None and self.ticks else None,
            sampler_cpu_percent=100.0 * cpu_s / duration if cpu_s is not None and duration > 0 else None,
            percentiles_exact=all(m.reservoir.exact for m in self.metrics.values()),
            metrics=metrics,
            energy_j=energy,
            energy_from_power_j=from_power,
            errors=dict(self.errors),
            lost=list(self.lost),
            unsupported=list(self.unsupported),
            marks=self.marks,
        )
