"""The reading side of the sampler: wake at the rate, call the pollers that are due, queue the raw values.

Tick k is due at t0 + k/rate (deadlines never accumulate the lateness of earlier ticks); a tick that falls more
than one period behind skips the deadlines it missed rather than bursting to catch up. Each poller has its own
period and next-due time on the same clock; slow pollers start one tick apart so that their calls do not all land on
one tick.

Pollers marked `blocking` (NVML's PCIe throughput waits ~20 ms, the process listing milliseconds) run in a second
thread on their own deadlines, so they never delay the fast ticks; their readings join the queue with the next
tick. Without the threads (`Sampler.sample_once`) every poller is read inline.

Nothing here interprets a value: what to stop reading (an unsupported metric, a lost device) is decided by the
processing side and handed back through `retire()`, which takes effect at the next tick, in the reading thread
itself, so that a poller is never reconfigured while it is being read.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpumon.pollers import Poller

MAX_SLEEP_S = 0.05  # sleep in chunks no longer than this, so that stop() is noticed within it


def next_tick_index(k: int, elapsed: float, period: float) -> int:
    """The tick to run after tick k, `elapsed` seconds after t0; its deadline is t0 + index * period.

    Normally k + 1. When more than a whole period late, the deadlines already missed are skipped (the latest of
    them runs at once) instead of being run back to back, and the grid itself never shifts.
    """
    return max(k + 1, math.floor(elapsed / period))


def advance(next_due: float, now: float, period: float) -> float:
    """A poller's next deadline on its own grid, past `now` (missed ones are skipped, not made up)."""
    return next_due + max(1, math.floor((now - next_due) / period) + 1) * period


@dataclass(slots=True)
class TickReads:
    """What one tick read: (poller index, values) per poller read; a value is an exception where that read failed.

    `failed` says some value is an exception (the processing side should see it at once); `error` is a bug in the
    reader itself, to be counted: no poller was read at such a tick.
    """

    t: float
    reads: list[tuple[int, Sequence[Any]]]
    failed: bool = False
    error: Exception | None = None


@dataclass(frozen=True)
class Retirement:
    """What to stop reading: columns of a poller (unsupported), whole pollers, whole groups (a device lost)."""

    columns: Mapping[int, Collection[str]]
    pollers: frozenset[int]
    groups: frozenset[str]


def read_poller(p: Poller) -> list[Any]:
    """One poller's values; a failed call becomes its exception, once per column."""
    try:
        return list(p.read())
    except Exception as exc:
        return [exc] * len(p.columns)


class Reader:
    """Reads `pollers` at `rate_hz` and queues a TickReads per tick, in a thread (`start`) or tick by tick (`tick`).

    Example:
        >>> from gpumon.host_backend import HostBackend
        >>> reader = Reader(HostBackend().pollers, rate_hz=100, batch_ticks=25)
        >>> reader.tick(0.0), reader.tick(0.01)  # True once 25 ticks are queued, or when a read failed
        (False, False)
        >>> [ticked.t for ticked in reader.take()]
        [0.0, 0.01]
    """

    def __init__(
        self,
        pollers: Sequence[Poller],
        rate_hz: float,
        clock: Callable[[], float] = time.monotonic,
        batch_ticks: int = 1,
    ) -> None:
        self.pollers = list(pollers)
        self.period = 1.0 / rate_hz
        self.clock = clock
        self.batch_ticks = batch_ticks  # tick() asks for processing once this many ticks are queued
        self.t0: float | None = None
        self._next_due = [0.0] * len(self.pollers)
        for n, i in enumerate([i for i, p in enumerate(self.pollers) if p.period_s > 0]):
            self._next_due[i] = (n * self.period) % self.pollers[i].period_s
        self._blocking = [i for i, p in enumerate(self.pollers) if p.blocking]
        self._retired: frozenset[int] = frozenset()
        self._lost: frozenset[str] = frozenset()
        self._requests: deque[Retirement] = deque()  # from retire(), applied by the next tick
        self._lane: list[tuple[int, Poller, Callable[[], Sequence[Any]], float]] | None = None  # see _build_lane
        self._slow_lane = False  # whether the blocking pollers run in their own thread
        self._slow_results: deque[tuple[int, list[Any]]] = deque()
        self._queue: list[TickReads] = []
        self._queue_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._busy_s = {"fast": 0.0, "slow": 0.0}
        self._cpu_s = {"fast": 0.0, "slow": 0.0}

    @property
    def busy_s(self) -> float:
        """Wall time the reading threads spent working (processing done in the tick thread included)."""
        return self._busy_s["fast"] + self._busy_s["slow"]

    @property
    def cpu_s(self) -> float:
        """CPU time of the reading threads (processing done in the tick thread included)."""
        return self._cpu_s["fast"] + self._cpu_s["slow"]

    # -- the queue, as the processing side sees it -----------------------------------------------------------
    def take(self) -> list[TickReads]:
        """Remove and return the queued ticks, oldest first."""
        with self._queue_lock:
            ticks, self._queue = self._queue, []
        return ticks

    def queued(self) -> list[TickReads]:
        """The queued ticks, left in the queue."""
        with self._queue_lock:
            return list(self._queue)

    def retire(self, retirement: Retirement) -> None:
        """Stop reading what `retirement` names, from the next tick on."""
        self._requests.append(retirement)

    # -- reading ---------------------------------------------------------------------------------------------
    def tick(self, t: float) -> bool:
        """Read the pollers due at `t` (seconds since t0) and queue their values.

        Returns True when the queue should be processed now: a batch is full, or a read failed (an unsupported
        metric or a lost device must stop being read before the next tick).
        """
        try:
            ticked = self._read(t)
        except Exception as exc:  # a bug here must not kill monitoring, nor the program being monitored
            ticked = TickReads(t, [], failed=True, error=exc)
        with self._queue_lock:
            self._queue.append(ticked)
            return ticked.failed or len(self._queue) >= self.batch_ticks

    def _read(self, t: float) -> TickReads:
        while self._requests:
            self._apply(self._requests.popleft())
        ticked = TickReads(t, [])
        reads = ticked.reads
        while self._slow_results:
            i, slow = self._slow_results.popleft()
            reads.append((i, slow))
            ticked.failed = ticked.failed or any(isinstance(v, BaseException) for v in slow)
        lost_now: set[str] | None = None  # a device lost at this tick is not read again in it
        next_due = self._next_due
        early = t + 0.5 * self.period  # a poller due within half a tick from now is read at this tick
        for i, p, read, period_s in self._lane if self._lane is not None else self._build_lane():
            if period_s:
                if early < next_due[i]:
                    continue
                next_due[i] = advance(next_due[i], t, period_s)
            if lost_now and p.group in lost_now:
                continue
            try:
                values = read()
            except Exception as exc:
                values = [exc] * len(p.columns)
                failed: BaseException | None = exc
            else:
                # only a partial poller returns an exception in place of a value; checked here, not per value
                failed = next((v for v in values if isinstance(v, BaseException)), None) if p.partial else None
            if failed is not None:
                ticked.failed = True
                if p.failure(failed) == "lost":
                    lost_now = (lost_now or set()) | {p.group}
            reads.append((i, values))
        return ticked

    def _build_lane(self) -> list[tuple[int, Poller, Callable[[], Sequence[Any]], float]]:
        # the pollers the tick reads, with their bound read() and period looked up once rather than every tick
        self._lane = [
            (i, p, p.read, p.period_s)
            for i, p in enumerate(self.pollers)
            if self._reads(i) and not (p.blocking and self._slow_lane)
        ]
        return self._lane

    def _reads(self, i: int) -> bool:
        return i not in self._retired and self.pollers[i].group not in self._lost

    def _apply(self, retirement: Retirement) -> None:
        for i, columns in retirement.columns.items():
            drop = self.pollers[i].drop
            if drop is not None:
                for column in columns:
                    drop(column)
        # rebound, not mutated: the slow thread reads these sets without a lock
        self._retired = self._retired | retirement.pollers
        self._lost = self._lost | retirement.groups
        self._lane = None

    # -- threads ---------------------------------------------------------------------------------------------
    def start(self, on_batch: Callable[[], None]) -> None:
        """Start reading in a daemon thread (t = 0 is now); `on_batch()` runs in it whenever tick() asks for it."""
        if self._threads:
            raise RuntimeError("Reader.start(): already started")
        self.t0 = self.clock()
        self._slow_lane = bool(self._blocking)
        self._lane = None  # the blocking pollers move to the slow thread
        self._threads = [threading.Thread(target=self._run_ticks, args=(on_batch,), name="gpumon-sampler", daemon=True)]
        if self._slow_lane:
            self._threads.append(threading.Thread(target=self._run_slow, name="gpumon-sampler-slow", daemon=True))
        for thread in reversed(self._threads):
            thread.start()

    def stop(self, timeout: float) -> None:
        """Ask the threads to end and wait up to `timeout` seconds for each."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def _run_ticks(self, on_batch: Callable[[], None]) -> None:
        t0 = self.t0 if self.t0 is not None else self.clock()
        cpu_start = time.thread_time()
        clock, period, stop, perf_counter = self.clock, self.period, self._stop, time.perf_counter
        k, busy = 0, 0.0
        while not stop.is_set():
            delay = t0 + k * period - clock()
            while delay > 0 and not stop.is_set():
                time.sleep(min(delay, MAX_SLEEP_S))  # time.sleep wakes more cheaply than Event.wait
                delay = t0 + k * period - clock()
            if stop.is_set():
                break
            started = perf_counter()
            if self.tick(clock() - t0):
                on_batch()
                # published once a batch, not every tick (thread_time is a system call)
                self._cpu_s["fast"] = time.thread_time() - cpu_start
                self._busy_s["fast"] = busy + perf_counter() - started
            busy += perf_counter() - started
            k = next_tick_index(k, clock() - t0, period)
        started = perf_counter()
        on_batch()  # what is still queued, processed in this thread so that its cost is counted
        self._busy_s["fast"] = busy + perf_counter() - started
        self._cpu_s["fast"] = time.thread_time() - cpu_start

    def _run_slow(self) -> None:
        t0 = self.t0 if self.t0 is not None else self.clock()
        cpu_start = time.thread_time()
        while not self._stop.is_set():
            due = [(self._next_due[i], i) for i in self._blocking if self._reads(i)]
            now = self.clock() - t0
            wait = min(due)[0] - now if due else 1.0
            if wait > 0:
                self._stop.wait(wait)  # wakes at once on stop(); this thread runs only a few times a second
                continue
            i = min(due)[1]
            p = self.pollers[i]
            # a period of 0 ("every tick") means every tick's period here: this thread has no ticks of its own
            self._next_due[i] = advance(self._next_due[i], now, p.period_s or self.period)
            started = time.perf_counter()
            self._slow_results.append((i, read_poller(p)))  # queued with the fast thread's next tick
            self._busy_s["slow"] += time.perf_counter() - started
            self._cpu_s["slow"] = time.thread_time() - cpu_start
        self._cpu_s["slow"] = time.thread_time() - cpu_start
