"""The sampler's two halves on their own: the reader (what is read when, queued raw) and the processor (what the
reads become), and the Retirement the second hands back to the first."""

import threading
import time

import pytest

from gpumon.pollers import Poller
from gpumon.processor import Processor
from gpumon.reader import Reader, Retirement, TickReads
from gpumon.recording import Recording, RecordingWriter
from gpumon.statistics import SummaryBuilder


class Unsupported(Exception):
    pass


class Lost(Exception):
    pass


def classify(exc):
    return "unsupported" if isinstance(exc, Unsupported) else "lost" if isinstance(exc, Lost) else "error"


def counting_poller(name, period_s=0.0, group=None, columns=("v",), values=None, drop=None, partial=False):
    """A poller that records each call; `values(n)` gives the n-th read's values (default: n for each column)."""
    calls = []

    def read():
        calls.append(len(calls))
        return values(len(calls) - 1) if values else [len(calls) - 1] * len(columns)

    cols = [f"{name}.{c}" for c in columns]
    units = ["count"] * len(cols)
    p = Poller(name, group or name, cols, units, period_s, read, classify=classify, drop=drop, partial=partial)
    return p, calls


def processor_for(pollers, writer=None):
    units = {c: u for p in pollers for c, u in zip(p.columns, p.units, strict=True)}
    return Processor(pollers, SummaryBuilder(100.0, units, set()), writer)


def test_reader_reads_each_poller_on_its_own_grid_and_asks_for_processing_per_batch():
    fast, fast_calls = counting_poller("fast")
    slow, slow_calls = counting_poller("slow", period_s=0.05)
    reader = Reader([fast, slow], rate_hz=100, batch_ticks=4)
    ticks = []
    for batch in range(2):
        assert [reader.tick((4 * batch + k) / 100) for k in range(4)] == [False, False, False, True]  # a full batch
        ticks += reader.take()
    assert [t.t for t in ticks] == [k / 100 for k in range(8)] and reader.take() == []
    assert len(fast_calls) == 8
    # every 5 ticks from t = 0 (a second slow poller would start a tick later: they are staggered)
    assert [t.t for t in ticks if any(i == 1 for i, _ in t.reads)] == [0.0, 0.05]
    assert all(not t.failed and t.error is None for t in ticks)


@pytest.mark.parametrize("inline", [False, True], ids=["raised", "in place of a value (partial poller)"])
def test_a_failed_read_asks_for_processing_at_once_and_a_lost_group_is_not_read_again_in_that_tick(inline):
    def gpu_reads(n):
        if n == 2 and not inline:
            raise Lost("GPU is lost")
        return [Lost("GPU is lost")] if n == 2 else [n]

    memory, _ = counting_poller("gpu1.memory", group="gpu1", values=gpu_reads, partial=inline)
    clocks, clock_calls = counting_poller("gpu1.clocks", group="gpu1")
    reader = Reader([memory, clocks], rate_hz=100, batch_ticks=100)
    assert [reader.tick(k / 100) for k in range(3)] == [False, False, True]
    third = reader.take()[-1]
    assert third.failed and [i for i, _ in third.reads] == [0]  # clocks skipped once memory said the GPU is lost
    assert isinstance(third.reads[0][1][0], Lost) and len(clock_calls) == 2


def test_retirement_takes_effect_at_the_next_tick_in_the_reading_call():
    dropped = []
    power, power_calls = counting_poller("power", columns=("a", "b"), drop=dropped.append)
    other, other_calls = counting_poller("other", group="gpu9")
    reader = Reader([power, other], rate_hz=100)
    reader.tick(0.0)
    reader.retire(Retirement({0: ["power.b"]}, frozenset(), frozenset({"gpu9"})))
    assert dropped == []  # nothing changes under a read that may be running
    reader.tick(0.01)
    assert dropped == ["power.b"] and len(power_calls) == 2 and len(other_calls) == 1
    reader.retire(Retirement({}, frozenset({0}), frozenset()))
    reader.tick(0.02)
    assert len(power_calls) == 2 and [t.reads for t in reader.take()][-1] == []


def test_a_bug_in_the_reader_is_queued_as_an_error_and_counted_by_the_processor(monkeypatch):
    ok, _ = counting_poller("ok")
    reader = Reader([ok], rate_hz=100)

    def broken(t):
        raise KeyError("a bug")

    monkeypatch.setattr(reader, "_read", broken)
    assert reader.tick(0.0) is True
    (ticked,) = reader.take()
    assert isinstance(ticked.error, KeyError) and ticked.reads == []
    proc = processor_for([ok])
    assert proc.process([ticked], marks=[]) is None
    summary = proc.summary(busy_s=None, cpu_s=None)
    assert summary.samples == 0 and summary.errors == {"sampler: KeyError: 'a bug'": 1}


def test_a_poller_that_breaks_its_contract_is_counted_and_the_others_recorded():
    broken = Poller("b", "b", ["b.v"], ["count"], 0.0, lambda: 7)  # not one value per column: a bug
    ok, _ = counting_poller("ok")
    reader = Reader([broken, ok], rate_hz=100)
    for k in range(3):
        reader.tick(k / 100)
    proc = processor_for([broken, ok])
    proc.process(reader.take(), marks=[])
    summary = proc.summary(busy_s=None, cpu_s=None)
    assert summary.samples == 3 and summary.metrics["ok.v"]["reads"] == 3
    assert sum(n for key, n in summary.errors.items() if key.startswith("sampler: TypeError")) == 3


def test_processor_turns_reads_into_fresh_stale_and_failed_cells_with_marks_in_time_order(tmp_path):
    p, _ = counting_poller("p", columns=("x", "y"))
    writer = RecordingWriter(tmp_path / "p.csv", p.columns, {"rate_hz": 100.0})
    proc = processor_for([p], writer)
    ticks = [
        TickReads(0.00, [(0, [5, "a,b"])]),
        TickReads(0.01, [(0, [5, RuntimeError("flaky")])], failed=True),
        TickReads(0.02, []),  # nothing due
        TickReads(0.03, [(0, [6, "a,b"])]),
    ]
    assert proc.process(ticks, marks=[(0.015, "step", 1), (0.5, "late", None)]) is None  # nothing to retire
    writer.close()
    rows = list(Recording(tmp_path / "p.csv").rows())
    assert [(t, kind, cells) for t, kind, _, _, cells in rows] == [
        (0.0, "s", ["5", "a,b"]),
        (0.01, "error", []),
        (0.01, "s", ["=", "!"]),
        (0.015, "mark", []),
        (0.02, "s", ["", ""]),
        (0.03, "s", ["6", "="]),
        (0.5, "mark", []),
    ]
    summary = proc.summary(busy_s=None, cpu_s=None)
    assert summary.metrics["p.x"]["fresh_fraction"] == pytest.approx(2 / 3) and summary.marks == 2
    assert summary.errors == {"p.y: flaky": 1}  # retried: an "error" is not a reason to stop reading


def test_processor_hands_back_what_to_stop_reading():
    power, _ = counting_poller("gpu0.power", group="gpu0", columns=("a", "b"))
    memory, _ = counting_poller("gpu0.memory", group="gpu0")
    host, _ = counting_poller("host")
    proc = processor_for([power, memory, host])
    unsupported = Unsupported("Not Supported")
    retirement = proc.process([TickReads(0.0, [(0, [1, unsupported]), (2, [3])], failed=True)], marks=[])
    assert retirement == Retirement({0: ["gpu0.power.b"]}, frozenset(), frozenset())
    retirement = proc.process([TickReads(0.01, [(0, [unsupported, None])], failed=True)], marks=[])
    assert retirement == Retirement({0: ["gpu0.power.a"]}, frozenset({0}), frozenset())
    lost = Lost("GPU is lost")
    retirement = proc.process(
        [TickReads(0.02, [(1, [lost])], failed=True), TickReads(0.03, [(1, [4]), (2, [5])])], marks=[]
    )
    assert retirement.groups == frozenset({"gpu0"})
    summary = proc.summary(busy_s=None, cpu_s=None)
    assert summary.metrics["gpu0.memory.v"]["reads"] == 0  # the read queued after the loss is not recorded
    assert summary.metrics["host.v"]["reads"] == 2 and summary.lost == ["gpu0"]
    assert proc.latest([])["host.v"] == 5 and proc.latest([TickReads(0.04, [(2, [6])])])["host.v"] == 6


def test_a_blocking_poller_read_at_every_tick_runs_in_its_own_thread():
    threads = []

    def read():
        threads.append(threading.current_thread().name)
        return [len(threads)]

    blocking = Poller("slow", "slow", ["slow.n"], ["count"], 0.0, read, blocking=True)
    reader = Reader([blocking], rate_hz=200)
    reader.start(on_batch=lambda: None)
    deadline = time.monotonic() + 120  # a bound for a stuck thread, far above what even a loaded machine needs
    while len(threads) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    reader.stop(timeout=5.0)
    assert len(threads) >= 5 and set(threads) == {"gpumon-sampler-slow"}
