"""The background sampler: a reader that only reads at each tick, a processor that records a batch at a time.

The reader (gpumon.reader) wakes on absolute deadlines, calls the pollers that are due and queues their raw
values. The processor (gpumon.processor) turns the queued ticks into cells, statistics and file rows every BATCH_S,
at once when a read failed, and at stop. Woken from sleep, the interpreter runs the same code several times slower
than back to back (cold caches); processing 25 ticks in one pass pays that once instead of 25 times. `latest()`
overlays the queued reads, so nothing a caller sees lags.

Once started, nothing here raises into the program being monitored: failures and gpumon's own bugs are counted
and reported by `summary()`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumon.pollers import Poller
from gpumon.processor import FLUSH_EVERY_S, Mark, Processor
from gpumon.reader import Reader, next_tick_index
from gpumon.recording import RecordingWriter
from gpumon.statistics import RESERVOIR_SIZE, Summary, SummaryBuilder

__all__ = ["BATCH_S", "FLUSH_EVERY_S", "JOIN_TIMEOUT_S", "Sampler", "next_tick_index"]

BATCH_S = 0.25  # the queued reads are processed this often; with FLUSH_EVERY_S it bounds what a crash loses
JOIN_TIMEOUT_S = 5.0


class Sampler:
    """Polls `pollers` at `rate_hz` in a daemon thread, writes rows to `out` (if given) and keeps a summary.

    `if_exists` says what to do when `out` is already a recording (see RecordingWriter): "error" (the default),
    "overwrite" or "append".

    Example (the host backend's pollers, which need no GPU; `Monitor` assembles the same from its backends):
        >>> import tempfile, time
        >>> from gpumon.host_backend import HostBackend
        >>> from gpumon.recording import Recording
        >>> run = tempfile.TemporaryDirectory()
        >>> sampler = Sampler(HostBackend().pollers, rate_hz=100, out=f"{run.name}/host.csv")
        >>> sampler.start(); time.sleep(0.2); sampler.stop()
        >>> sampler.columns
        ['host.cpu_pct', 'host.tree_cpu_pct', 'host.tree_rss_bytes', 'host.tree_processes']
        >>> print(sampler.summary())  # doctest: +ELLIPSIS
        gpumon: ... samples, achieved ... Hz (target 100), ...
        >>> rec = Recording(f"{run.name}/host.csv")
        >>> rec.columns == sampler.columns, rec.trailer["ticks"] == sampler.summary().samples
        (True, True)
        >>> run.cleanup()
    """

    def __init__(
        self,
        pollers: Sequence[Poller],
        rate_hz: float = 100.0,
        out: str | Path | None = None,
        meta: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reservoir_size: int = RESERVOIR_SIZE,
        if_exists: str = "error",
    ) -> None:
        if not (isinstance(rate_hz, (int, float)) and 0 < rate_hz <= 10_000):
            raise ValueError(f"rate_hz must be a number in (0, 10000], got {rate_hz!r}")
        self.rate_hz = float(rate_hz)
        self.clock = clock
        self.pollers = list(pollers)
        self.columns = [c for p in self.pollers for c in p.columns]
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"pollers: duplicate column names in {self.columns}")
        self.units = {c: u for p in self.pollers for c, u in zip(p.columns, p.units, strict=True)}
        counters = {c for p in self.pollers for c in p.counter_columns}
        writer = None
        if out is not None:
            periods = {p.name: p.period_s for p in self.pollers}
            header = {**(meta or {}), "rate_hz": self.rate_hz, "units": self.units, "counters": sorted(counters)}
            header.update(periods=periods, start_unix=time.time())
            writer = RecordingWriter(out, self.columns, header, if_exists=if_exists)
        builder = SummaryBuilder(self.rate_hz, self.units, counters, reservoir_size)
        self.processor = Processor(self.pollers, builder, writer)
        self.reader = Reader(self.pollers, self.rate_hz, clock, batch_ticks=max(1, round(BATCH_S * self.rate_hz)))
        self._lock = threading.Lock()  # the processor's state: one batch at a time, and latest()/summary()
        self._marks: deque[Mark] = deque()

    @property
    def t0(self) -> float | None:
        """The clock's reading at start() (t = 0); None before."""
        return self.reader.t0

    # -- control ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread (t=0 is now)."""
        self.reader.start(on_batch=self._process)

    def stop(self) -> None:
        """Stop the thread, write the trailer and close the file. Never raises; safe to call twice."""
        self.reader.stop(JOIN_TIMEOUT_S)
        with self._lock:
            self._process_locked()  # left over if the thread did not end in time, or sample_once was never batched
            try:
                self.processor.close(self._take_marks(), self.reader.busy_s, self.reader.cpu_s)
            except Exception as exc:
                self.processor.count_internal_error(exc)

    def sample_once(self, t: float) -> None:
        """One tick at time `t` (seconds since start), read and processed at once; tests call it with a fake clock."""
        self.reader.tick(t)
        self._process()

    # -- what the program sees -------------------------------------------------------------------------------
    def mark(self, label: str, value: Any = None) -> None:
        """Queue an annotation with the current time; it is written with the next batch."""
        t0 = self.reader.t0 if self.reader.t0 is not None else self.clock()
        self._marks.append((self.clock() - t0, str(label), value))

    def latest(self) -> dict[str, Any]:
        """The last value read of every metric (None before its first read), queued reads included."""
        with self._lock:
            return self.processor.latest(self.reader.queued())

    def status(self) -> dict[str, Any]:
        """Cheap progress figures (no percentiles): ticks, achieved rate so far, errors counted."""
        return self.processor.status(self.reader.queued())

    def summary(self) -> Summary:
        with self._lock:
            self._process_locked()
            return self.processor.summary(busy_s=self.reader.busy_s, cpu_s=self.reader.cpu_s)

    # -- between the two -------------------------------------------------------------------------------------
    def _process(self) -> None:
        with self._lock:
            self._process_locked()

    def _process_locked(self) -> None:
        ticks = self.reader.take()
        if not ticks and not self._marks:
            return
        try:
            retirement = self.processor.process(ticks, self._take_marks())
        except Exception as exc:  # a bug here must not kill monitoring, nor the program being monitored
            self.processor.count_internal_error(exc)
            return
        if retirement is not None:
            self.reader.retire(retirement)

    def _take_marks(self) -> list[Mark]:
        marks = []
        while self._marks:
            marks.append(self._marks.popleft())
        return marks
