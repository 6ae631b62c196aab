"""Recording files on a filesystem that nodes and restarts share: per-host names, no silent truncation, append."""

import threading
import time

import pytest

import gpumon
from gpumon.pollers import Poller
from gpumon.recording import Recording, RecordingError, RecordingExistsError, recording_path
from gpumon.reports import summarize_recording
from gpumon.sampler import Sampler


def counter_poller(name="n"):
    state = {"n": 0}

    def read():
        state["n"] += 1
        return [state["n"]]

    return Poller(name, name, [f"{name}.count"], ["count"], 0.0, read)


def run(path, ticks, if_exists="error", poller=None, start=0.0):
    sampler = Sampler([poller or counter_poller()], rate_hz=100, out=path, clock=lambda: 0.0, if_exists=if_exists)
    for k in range(ticks):
        sampler.sample_once(start + k / 100)
    sampler.stop()
    return sampler


def test_recording_path_names_the_host_and_numbers_restarts(tmp_path):
    shared = tmp_path / "shared" / "run7"
    first = recording_path(shared, host="node03")
    assert first == shared / "gpumon.node03.csv" and first.read_bytes() == b""
    other_node = recording_path(shared, host="node04")
    assert other_node == shared / "gpumon.node04.csv"
    run(first, 5)
    restarts = [recording_path(shared, host="node03") for _ in range(2)]
    assert restarts == [shared / "gpumon.node03.1.csv", shared / "gpumon.node03.2.csv"]
    assert Recording(first).trailer["ticks"] == 5  # the earlier run is untouched
    default = recording_path(shared, "train")
    assert default.name == f"train.{gpumon.host_name()}.csv"


def test_recording_path_never_gives_two_processes_the_same_file(tmp_path):
    paths, barrier = [], threading.Barrier(8)

    def claim():
        barrier.wait()
        paths.append(recording_path(tmp_path, host="node01"))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 8


@pytest.mark.parametrize(("name", "host"), [("a/b", "node"), ("gpumon", "../x"), ("", "node"), ("gpumon", "")])
def test_recording_path_refuses_names_that_leave_the_directory(tmp_path, name, host):
    with pytest.raises(ValueError, match="letters, digits"):
        recording_path(tmp_path, name, host=host)


def test_an_existing_recording_is_never_truncated_by_default(tmp_path):
    out = tmp_path / "gpu.csv"
    run(out, 5)
    before = out.read_bytes()
    with pytest.raises(RecordingExistsError, match="append.*overwrite"):
        run(out, 3)
    mon = gpumon.Monitor(rate_hz=100, out=out, backend="host")  # the call an application makes today
    with pytest.raises(RecordingExistsError):
        mon.start()
    assert out.read_bytes() == before
    run(out, 3, if_exists="overwrite")
    assert Recording(out).trailer["ticks"] == 3


def test_monitor_writes_a_new_or_empty_file_as_before(tmp_path):
    out = recording_path(tmp_path, host="node01")  # empty
    with gpumon.Monitor(rate_hz=100, out=out, backend="host") as mon:
        mon.mark("step", 1)
    assert Recording(out).marks()[0][1:] == ("step", "1")
    with pytest.raises(ValueError, match="if_exists"):
        gpumon.Monitor(out=out, if_exists="replace")


def test_an_appended_run_continues_the_file_and_its_summary(tmp_path, monkeypatch):
    out = tmp_path / "gpu.csv"
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0)  # the wall-clock start written into each header
    run(out, 50)
    monkeypatch.setattr(time, "time", lambda: 1_000_010.0)  # the restart, 10 s later
    run(out, 30, if_exists="append")
    monkeypatch.undo()
    rec = Recording(out)
    rows = list(rec.rows())
    kinds = [kind for _, kind, *_ in rows]
    assert kinds.count("s") == 80 and kinds.count("segment") == 1
    assert [t for t, kind, *_ in rows if kind != "s"] == [10.0]
    times = [t for t, *_ in rows]
    assert times == sorted(times) and times[-1] == pytest.approx(10.29)  # on the first run's time axis
    assert rec.trailer["ticks"] == 80  # totals of both runs
    summary = summarize_recording(out)
    assert summary.samples == 80 and summary.missed_ticks == 0  # the pause between the runs is not missed ticks
    assert summary.duration_s == pytest.approx(0.49 + 0.29)
    assert summary.achieved_rate_hz == pytest.approx(100.0)


def test_append_refuses_a_run_with_other_columns_and_survives_a_torn_last_line(tmp_path):
    out = tmp_path / "gpu.csv"
    run(out, 5)
    before = out.read_bytes()
    with pytest.raises(RecordingError, match="columns differ"):
        run(out, 5, if_exists="append", poller=counter_poller("other"))
    assert out.read_bytes() == before
    out.write_bytes(before + b"0.12")  # a crash in the middle of a row
    run(out, 5, if_exists="append")
    assert summarize_recording(out).samples == 10
    not_ours = tmp_path / "notes.csv"
    not_ours.write_text("a,b\n")
    with pytest.raises(RecordingError, match="not a gpumon recording"):
        run(not_ours, 1, if_exists="append")
