"""The background sampler: absolute deadlines on the monotonic clock, one row per tick, never raises.

Tick k is due at t0 + k/rate (deadlines never accumulate the lateness of earlier ticks); a tick that falls more
than one period behind skips the deadlines it missed rather than bursting to catch up. Each poller has its own
period and next-due time on the same clock. Any exception from a poller or from the file is counted and reported in
the summary; a device reported lost stops being read while the others go on.

Pollers marked `blocking` (NVML's PCIe throughput waits ~20 ms, the process listing milliseconds) run in a second
thread on their own deadlines, so they never delay the fast ticks; their readings enter the file and the
statistics with the next tick. Without the threads (`sample_once` called directly) everything runs inline.

A tick in the thread only reads: the raw values are kept and turned into cells, statistics and file rows a batch
of ticks at a time (every BATCH_S, at once when a read failed, and at stop). Woken from sleep, the interpreter runs
the same code several times slower than back to back (cold caches); processing 25 ticks in one pass pays that
once instead of 25 times. `latest()` overlays the pending reads, so nothing a caller sees lags.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumon.pollers import Poller
from gpumon.recording import FAILED, MISSING, STALE, RecordingWriter
from gpumon.statistics import RESERVOIR_SIZE, Summary, SummaryBuilder

FLUSH_EVERY_S = 1.0  # with BATCH_S, a crash loses at most about FLUSH_EVERY_S + BATCH_S of the file
BATCH_S = 0.25  # the thread processes its raw reads this often
JOIN_TIMEOUT_S = 5.0
MAX_SLEEP_S = 0.05


def next_tick_index(k: int, elapsed: float, period: float) -> int:
    """The tick to run after tick k, `elapsed` seconds after t0; its deadline is t0 + index * period.

    Normally k + 1. When more than a whole period late, the deadlines already missed are skipped (the latest of
    them runs at once) instead of being run back to back, and the grid itself never shifts.
    """
    return max(k + 1, math.floor(elapsed / period))


def _advance(next_due: float, now: float, period: float) -> float:
    # the next deadline of a poller on its own grid, past `now` (missed ones are skipped, not made up)
    return next_due + max(1, math.floor((now - next_due) / period) + 1) * period


def _cell(value: Any) -> str:
    # sample rows are joined with "," without the csv module (it costs more than the rest of a tick), so text
    # that could break the row is quoted here as csv would quote it; numbers, by far the common case, never are
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float:
        return repr(round(value, 3))
    text = str(value)
    if any(ch in text for ch in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


class Sampler:
    """Polls `pollers` at `rate_hz` in a daemon thread, writes rows to `out` (if given) and keeps a summary.

    Example:
        >>> sampler = Sampler(HostBackend().pollers, rate_hz=100, out="host.csv")
        >>> sampler.start(); time.sleep(1.0); sampler.stop()
        >>> print(sampler.summary())
    """

    def __init__(
        self,
        pollers: Sequence[Poller],
        rate_hz: float = 100.0,
        out: str | Path | None = None,
        meta: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reservoir_size: int = RESERVOIR_SIZE,
    ) -> None:
        if not (isinstance(rate_hz, (int, float)) and 0 < rate_hz <= 10_000):
            raise ValueError(f"rate_hz must be a number in (0, 10000], got {rate_hz!r}")
        self.rate_hz = float(rate_hz)
        self.period = 1.0 / self.rate_hz
        self.clock = clock
        self.pollers = list(pollers)
        self.columns = [c for p in self.pollers for c in p.columns]
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"pollers: duplicate column names in {self.columns}")
        self.units = {c: u for p in self.pollers for c, u in zip(p.columns, p.units, strict=True)}
        counters = {c for p in self.pollers for c in p.counter_columns}
        self.index = {c: i for i, c in enumerate(self.columns)}
        self._last: list[Any] = [None] * len(self.columns)
        self._active = list(range(len(self.pollers)))
        self._fast: list[tuple[int, Poller, Callable[[], Sequence[Any]], float]] | None = None  # see _fast_pollers
        self._blank = [MISSING] * len(self.columns)
        self._dropped: set[str] = set()
        self._lost_groups: set[str] = set()
        slow = [i for i, p in enumerate(self.pollers) if p.period_s > 0]
        # slow pollers start one tick apart so that their millisecond calls do not all land on one tick
        self._next_due = [0.0] * len(self.pollers)
        for n, i in enumerate(slow):
            self._next_due[i] = (n * self.period) % self.pollers[i].period_s
        self._builder = SummaryBuilder(self.rate_hz, self.units, counters, reservoir_size)
        # per poller: (column, cell index, statistics) of each value it returns, looked up once here
        self._plan = [[(c, self.index[c], self._builder.metrics[c]) for c in p.columns] for p in self.pollers]
        self._lock = threading.Lock()
        self._marks: deque[tuple[float, str, Any]] = deque()
        self._reported: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slow_thread: threading.Thread | None = None
        self._slow = [i for i, p in enumerate(self.pollers) if p.blocking]
        self._slow_results: deque[tuple[int, list[Any]]] = deque()
        self._slow_cpu_s = 0.0
        self._slow_busy_s = 0.0
        self.t0: float | None = None
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self._next_flush = FLUSH_EVERY_S
        self._now_t = 0.0
        # ticks read but not yet processed: (t, [(poller index, values), ...])
        self._pending: list[tuple[float, list[tuple[int, Sequence[Any]]]]] = []
        self._batch_ticks = max(1, round(BATCH_S * self.rate_hz))
        self._writer: RecordingWriter | None = None
        if out is not None:
            periods = {p.name: p.period_s for p in self.pollers}
            header = {**(meta or {}), "rate_hz": self.rate_hz, "units": self.units, "counters": sorted(counters)}
            header.update(periods=periods, start_unix=time.time())
            self._writer = RecordingWriter(out, self.columns, header)

    # -- control ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread (t=0 is now)."""
        if self._thread is not None:
            raise RuntimeError("Sampler.start(): already started")
        self.t0 = self.clock()
        self._fast = None  # the blocking pollers move to the slow thread
        self._thread = threading.Thread(target=self._run, name="gpumon-sampler", daemon=True)
        if self._slow:
            self._slow_thread = threading.Thread(target=self._run_slow, name="gpumon-sampler-slow", daemon=True)
            self._slow_thread.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, write the trailer and close the file. Never raises; safe to call twice."""
        self._stop.set()
        for thread in (self._thread, self._slow_thread):
            if thread is not None:
                thread.join(JOIN_TIMEOUT_S)
        with self._lock:
            self._process_safely()  # left over if the thread did not end in time, or sample_once was never batched
            events: list[tuple[float, str, str, str]] = []
            self._take_marks(events)  # marks made after the last tick
            if self._writer is not None:
                try:
                    for et, kind, label, value in events:
                        self._writer.event(et, kind, label, value)
                    self._writer.close(
                        {
                            "ticks": self._builder.ticks,
                            "busy_s": self.busy_s + self._slow_busy_s,
                            "cpu_s": self.cpu_s + self._slow_cpu_s,
                            "errors": self._builder.errors,
                            "lost": self._builder.lost,
                        }
                    )
                except OSError as exc:
                    self._count("file", f"closing failed: {exc}", "error")
                self._writer = None

    def mark(self, label: str, value: Any = None) -> None:
        """Queue an annotation with the current time; the sampler thread writes it with the next tick."""
        t0 = self.t0 if self.t0 is not None else self.clock()
        self._marks.append((self.clock() - t0, str(label), value))

    def latest(self) -> dict[str, Any]:
        """The last value read of every metric (None before its first read), pending reads included."""
        with self._lock:
            last = dict(zip(self.columns, self._last, strict=True))
            for _, reads in self._pending:
                for i, values in reads:
                    for column, value in zip(self.pollers[i].columns, values, strict=True):
                        if not isinstance(value, BaseException):
                            last[column] = value
        return last

    def status(self) -> dict[str, Any]:
        """Cheap progress figures (no percentiles): ticks, achieved rate so far, errors counted."""
        b, pending = self._builder, self._pending
        ticks = b.ticks + len(pending)
        first = b.first_t if b.ticks else (pending[0][0] if pending else 0.0)
        last = pending[-1][0] if pending else (b.last_t or 0.0)
        rate = (ticks - 1) / (last - first) if ticks > 1 and last > first else 0.0
        return {"ticks": ticks, "achieved_rate_hz": rate, "errors": sum(b.errors.values())}

    def summary(self) -> Summary:
        with self._lock:
            self._process()
            return self._builder.finish(busy_s=self.busy_s + self._slow_busy_s, cpu_s=self.cpu_s + self._slow_cpu_s)

    # -- the loop --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = self.t0 if self.t0 is not None else self.clock()
        cpu_start = time.thread_time()
        clock, period, stop, lock, perf_counter = self.clock, self.period, self._stop, self._lock, time.perf_counter
        k = 0
        while not stop.is_set():
            delay = t0 + k * period - clock()
            while delay > 0 and not stop.is_set():
                # time.sleep wakes more cheaply than Event.wait; chunks bound the latency of stop()
                time.sleep(min(delay, MAX_SLEEP_S))
                delay = t0 + k * period - clock()
            if stop.is_set():
                break
            started = perf_counter()
            with lock:
                if self._tick(clock() - t0, process=False):
                    self.cpu_s = time.thread_time() - cpu_start  # a system call: once a batch, not every tick
            self.busy_s += perf_counter() - started
            k = next_tick_index(k, clock() - t0, period)
        started = perf_counter()
        with lock:
            self._process_safely()
        self.busy_s += perf_counter() - started
        self.cpu_s = time.thread_time() - cpu_start

    def _run_slow(self) -> None:
        t0 = self.t0 if self.t0 is not None else self.clock()
        cpu_start = time.thread_time()
        while not self._stop.is_set():
            due = [(self._next_due[i], i) for i in self._slow if i in self._active]
            now = self.clock() - t0
            wait = min(due)[0] - now if due else 1.0
            if wait > 0:
                self._stop.wait(wait)  # wakes at once on stop(); this thread runs only a few times a second
                continue
            i = min(due)[1]
            p = self.pollers[i]
            self._next_due[i] = _advance(self._next_due[i], now, p.period_s)
            started = time.perf_counter()
            try:
                values = list(p.read())
            except Exception as exc:
                values = [exc] * len(p.columns)
            self._slow_busy_s += time.perf_counter() - started
            self._slow_results.append((i, values))  # recorded by the fast thread at its next tick
            self._slow_cpu_s = time.thread_time() - cpu_start
        self._slow_cpu_s = time.thread_time() - cpu_start

    def sample_once(self, t: float) -> None:
        """One tick at time `t` (seconds since start), read and processed at once; tests call it with a fake clock."""
        with self._lock:
            self._tick(t, process=True)

    def _tick(self, t: float, process: bool) -> bool:
        """Read the pollers due at `t`; process the queued ticks when `process`, a read failed or a batch is full.

        Returns True when it processed. Caller holds the lock.
        """
        try:
            failed = self._read(t)
        except Exception as exc:  # a bug here must not kill monitoring, nor the program being monitored
            self._internal_error(exc)
            failed = True
        if process or failed or len(self._pending) >= self._batch_ticks:
            self._process_safely()
            return True
        return False

    def _process_safely(self) -> None:
        try:
            self._process()
        except Exception as exc:
            self._pending.clear()
            self._internal_error(exc)

    def _internal_error(self, exc: Exception) -> None:
        self._count("sampler", f"{type(exc).__name__}: {exc}", "error")

    def _fast_pollers(self) -> list[tuple[int, Poller, Callable[[], Sequence[Any]], float]]:
        # the pollers this thread reads, with their bound read() and period looked up once rather than every
        # tick; rebuilt (self._fast = None) whenever a poller is dropped or moves to the slow thread
        slow_lane = self._slow_thread is not None
        self._fast = [
            (i, p, p.read, p.period_s)
            for i in self._active
            if not ((p := self.pollers[i]).blocking and slow_lane) and p.group not in self._lost_groups
        ]
        return self._fast

    def _read(self, t: float) -> bool:
        """Read the pollers due at `t` and queue the raw values; True when a read failed (process it at once)."""
        reads: list[tuple[int, Sequence[Any]]] = []
        failed = False
        while self._slow_results:
            reads.append(self._slow_results.popleft())
        lost = self._lost_groups
        lost_now: set[str] = set()  # a GPU lost at this tick is not read again in it
        next_due = self._next_due
        early = t + 0.5 * self.period  # a poller due within half a tick from now is read at this tick
        for i, p, read, period_s in self._fast if self._fast is not None else self._fast_pollers():
            if lost_now and p.group in lost_now:
                continue
            if period_s > 0:
                if early < next_due[i]:
                    continue
                next_due[i] = _advance(next_due[i], t, period_s)
            try:
                values = read()
            except Exception as exc:
                values = [exc] * len(p.columns)
            for value in values:
                if isinstance(value, BaseException):
                    failed = True
                    if self._classify(p, value) == "lost" and p.group not in lost:
                        lost_now.add(p.group)
            reads.append((i, values))
        self._pending.append((t, reads))
        return failed

    def _process(self) -> None:
        """Turn the queued ticks into cells, statistics and rows, in order; marks go in before the first later row."""
        pending, self._pending = self._pending, []
        if not pending and not self._marks:
            return
        marks: list[tuple[float, str, str, str]] = []
        if self._marks:
            self._take_marks(marks)
        writer, record, blank, add_tick = self._writer, self._record, self._blank, self._builder.add_tick
        lost, pollers = self._lost_groups, self.pollers
        rows: list[str] = []
        m = 0
        for t, reads in pending:
            self._now_t = t
            cells = blank.copy()
            events: list[tuple[float, str, str, str]] = []
            while m < len(marks) and marks[m][0] <= t:
                events.append(marks[m])
                m += 1
            for i, values in reads:
                if (lost and pollers[i].group in lost) or i not in self._active:
                    continue  # lost or dropped at an earlier tick of this batch
                record(i, values, t, cells, events)
            add_tick(t)
            if writer is not None:
                rows.extend(writer.event_line(*e) for e in events)
                rows.append(writer.sample_line(t, cells))
        if writer is not None:
            rows.extend(writer.event_line(*e) for e in marks[m:])
            try:
                writer.write(rows)
                if self._now_t >= self._next_flush:
                    writer.flush()
                    self._next_flush = self._now_t + FLUSH_EVERY_S
            except OSError as exc:  # disk full, file removed: keep sampling in memory, report it
                self._count("file", f"writing stopped: {exc}", "error")
                self._writer = None

    def _classify(self, p: Poller, exc: BaseException) -> str:
        try:
            return p.classify(exc)
        except Exception:
            return "error"

    def _record(self, i: int, values: Sequence[Any], t: float, cells: list[str], events: list) -> None:
        """Turn one poller's values into cells (fresh, `=` stale, `!` failed) and statistics."""
        last, dropped = self._last, self._dropped
        for (column, j, stats), value in zip(self._plan[i], values, strict=True):
            if dropped and column in dropped:
                continue
            if value == last[j] and not isinstance(value, BaseException):
                cells[j] = STALE
                stats.add_stale(t, value)
            elif isinstance(value, BaseException):
                cells[j] = FAILED
                self._failed(self.pollers[i], i, column, value, events)
            else:
                cells[j] = _cell(value)
                last[j] = value
                stats.add(t, value, True)

    def _take_marks(self, events: list[tuple[float, str, str, str]]) -> None:
        while self._marks:
            mt, label, value = self._marks.popleft()
            self._builder.marks += 1
            events.append((mt, "mark", label, "" if value is None else str(value)))

    def _failed(self, p: Poller, i: int, column: str, exc: BaseException, events: list) -> None:
        failure = self._classify(p, exc)
        text = str(exc) or type(exc).__name__
        self._count(column, text, failure)
        if (column, text) not in self._reported:
            self._reported.add((column, text))
            events.append((self._now_t, "error", column, f"{failure}: {text}"))
        if failure == "unsupported":
            self._dropped.add(column)
            if p.drop is not None:
                p.drop(column)
            if all(c in self._dropped for c in p.columns) and i in self._active:
                self._active.remove(i)
                self._fast = None
        elif failure == "lost" and p.group not in self._lost_groups:
            self._lost_groups.add(p.group)
            self._active = [a for a in self._active if self.pollers[a].group != p.group]
            self._fast = None
            self._dropped.update(c for q in self.pollers if q.group == p.group for c in q.columns)

    def _count(self, column: str, text: str, failure: str) -> None:
        self._builder.add_error(column, text, failure)
