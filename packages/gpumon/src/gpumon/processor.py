"""The processing side of the sampler: queued raw reads -> cells, statistics, file rows, first errors.

Each value becomes a cell: a number when it differs from the previous reading (fresh), `=` when it is the same
again (stale), `!` when the read failed; metrics not read at a tick stay empty. The statistics see the same fresh
and stale readings. Marks go into the file before the first sample row later than them.

Failures are sorted here: an unsupported metric is counted once and dropped; a lost device is counted once and all
of its metrics are dropped; anything else is counted and read again at its next period. What must stop being read
is returned to the caller as a `Retirement` for the reader.

Rows reach the disk in one write per batch and are flushed every FLUSH_EVERY_S of sampled time: with batches of
`Sampler`'s BATCH_S, a crash loses at most about FLUSH_EVERY_S + BATCH_S of the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpumon.pollers import Poller
from gpumon.reader import Retirement, TickReads
from gpumon.recording import FAILED, MISSING, STALE, RecordingWriter
from gpumon.statistics import Summary, SummaryBuilder

FLUSH_EVERY_S = 1.0

Mark = tuple[float, str, Any]  # (t, label, value), as Sampler.mark() queued it
Event = tuple[float, str, str, str]  # (t, kind, label, value): a mark or error row of the file


def cell(value: Any) -> str:
    """A fresh value as a file cell.

    Sample rows are joined with "," without the csv module (it costs more than the rest of a tick), so text that
    could break the row is quoted here as csv would quote it; numbers, by far the common case, never are.
    """
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float:
        return repr(round(value, 3))
    text = str(value)
    if any(ch in text for ch in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


class Processor:
    """Turns batches of TickReads (and marks) into statistics and, with a writer, file rows.

    Example:
        >>> builder = SummaryBuilder(100.0, {"n.count": "count"}, set())
        >>> proc = Processor([Poller("n", "n", ["n.count"], ["count"], 0.0, lambda: [1])], builder, writer=None)
        >>> proc.process([TickReads(0.0, [(0, [1])]), TickReads(0.01, [(0, [1])])], marks=[])
        >>> proc.summary(busy_s=None, cpu_s=None).metrics["n.count"]["fresh_fraction"]
        0.5
    """

    def __init__(self, pollers: Sequence[Poller], builder: SummaryBuilder, writer: RecordingWriter | None) -> None:
        self.pollers = list(pollers)
        self.builder = builder
        self.writer = writer
        self.columns = [c for p in self.pollers for c in p.columns]
        index = {c: j for j, c in enumerate(self.columns)}
        # per poller: (column, cell index, statistics) of each value it returns, looked up once here
        self._plan = [[(c, index[c], builder.metrics[c]) for c in p.columns] for p in self.pollers]
        self._last: list[Any] = [None] * len(self.columns)
        self._blank = [MISSING] * len(self.columns)
        self._dropped: set[str] = set()
        self._retired: set[int] = set()
        self._lost: set[str] = set()
        self._reported: set[tuple[str, str]] = set()
        self._next_flush = FLUSH_EVERY_S

    def process(self, ticks: Sequence[TickReads], marks: Sequence[Mark]) -> Retirement | None:
        """Record `ticks` in order, with `marks` between them; returns what the reader should stop reading."""
        events: list[Event] = [(t, "mark", label, "" if value is None else str(value)) for t, label, value in marks]
        self.builder.marks += len(marks)
        dropped: dict[int, list[str]] = {}
        retired, lost = len(self._retired), len(self._lost)
        writer, add_tick, blank, record = self.writer, self.builder.add_tick, self._blank, self._record
        retired_pollers, lost_groups, pollers = self._retired, self._lost, self.pollers  # updated in place
        rows: list[str] = []
        m = 0
        for tick in ticks:
            if tick.error is not None:
                self.count_internal_error(tick.error)
                continue
            t = tick.t
            tick_events: list[Event] = []
            while m < len(events) and events[m][0] <= t:
                tick_events.append(events[m])
                m += 1
            cells = blank.copy()
            for i, values in tick.reads:
                if i in retired_pollers or (lost_groups and pollers[i].group in lost_groups):
                    continue  # dropped at an earlier tick of this batch, or read before the reader heard of it
                try:
                    record(i, values, t, cells, tick_events, dropped)
                except Exception as exc:  # a poller that broke its contract (not one value per column)
                    self.count_internal_error(exc)
            add_tick(t)
            if writer is not None:
                rows.extend(writer.event_line(*e) for e in tick_events)
                rows.append(writer.sample_line(t, cells))
        if writer is not None:
            rows.extend(writer.event_line(*e) for e in events[m:])
            self._write(rows, ticks[-1].t if ticks else None)
        if not dropped and len(self._retired) == retired and len(self._lost) == lost:
            return None
        return Retirement(dropped, frozenset(self._retired), frozenset(self._lost))

    def _record(self, i: int, values: Sequence[Any], t: float, cells: list[str], events: list, dropped: dict) -> None:
        """One poller's values -> cells (fresh, `=` stale, `!` failed) and statistics."""
        last, gone = self._last, self._dropped
        for (column, j, stats), value in zip(self._plan[i], values, strict=True):
            if gone and column in gone:
                continue
            if value == last[j]:  # never an exception: last[] holds values only
                cells[j] = STALE
                stats.add_stale(t, value)
            elif isinstance(value, BaseException):
                cells[j] = FAILED
                self._failed(i, column, value, t, events, dropped)
            else:
                cells[j] = cell(value)
                last[j] = value
                stats.add(t, value, True)

    def _failed(self, i: int, column: str, exc: BaseException, t: float, events: list, dropped: dict) -> None:
        p = self.pollers[i]
        failure = p.failure(exc)
        text = str(exc) or type(exc).__name__
        self.builder.add_error(column, text, failure)
        if (column, text) not in self._reported:  # the file gets the first of each distinct error
            self._reported.add((column, text))
            events.append((t, "error", column, f"{failure}: {text}"))
        if failure == "unsupported":
            self._dropped.add(column)
            dropped.setdefault(i, []).append(column)
            if all(c in self._dropped for c in p.columns):
                self._retired.add(i)
        elif failure == "lost" and p.group not in self._lost:
            self._lost.add(p.group)
            self._dropped.update(c for q in self.pollers if q.group == p.group for c in q.columns)

    def _write(self, rows: list[str], t: float | None) -> None:
        writer = self.writer
        if writer is None:
            return
        try:
            writer.write(rows)
            if t is not None and t >= self._next_flush:
                writer.flush()
                self._next_flush = t + FLUSH_EVERY_S
        except OSError as exc:  # disk full, file removed: keep sampling in memory, report it
            self.builder.add_error("file", f"writing stopped: {exc}", "error")
            self.writer = None

    def count_internal_error(self, exc: Exception) -> None:
        """A bug in gpumon itself: counted and shown by the summary, never raised into the program."""
        self.builder.add_error("sampler", f"{type(exc).__name__}: {exc}", "error")

    def latest(self, queued: Sequence[TickReads]) -> dict[str, Any]:
        """The last value read of every metric (None before its first read), `queued` reads included."""
        last = dict(zip(self.columns, self._last, strict=True))
        for tick in queued:
            for i, values in tick.reads:
                for column, value in zip(self.pollers[i].columns, values, strict=True):
                    if not isinstance(value, BaseException):
                        last[column] = value
        return last

    def status(self, queued: Sequence[TickReads]) -> dict[str, Any]:
        """Ticks, achieved rate so far and errors counted, `queued` ticks included (no percentiles: cheap)."""
        b = self.builder
        ticks = b.ticks + len(queued)
        first = b.first_t if b.first_t is not None else (queued[0].t if queued else 0.0)
        last = queued[-1].t if queued else (b.last_t or 0.0)
        rate = (ticks - 1) / (last - first) if ticks > 1 and last > first else 0.0
        return {"ticks": ticks, "achieved_rate_hz": rate, "errors": sum(b.errors.values())}

    def summary(self, busy_s: float | None, cpu_s: float | None) -> Summary:
        return self.builder.finish(busy_s=busy_s, cpu_s=cpu_s)

    def close(self, marks: Sequence[Mark], busy_s: float, cpu_s: float) -> None:
        """Write the marks made after the last tick and the trailer, and close the file."""
        self.builder.marks += len(marks)
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            writer.write([writer.event_line(t, "mark", label, "" if v is None else str(v)) for t, label, v in marks])
            b = self.builder
            writer.close({"ticks": b.ticks, "busy_s": busy_s, "cpu_s": cpu_s, "errors": b.errors, "lost": b.lost})
        except OSError as exc:
            self.builder.add_error("file", f"closing failed: {exc}", "error")
