"""One writer per output directory: a second `lmtrain train` / `prepare` into a directory in use fails at once,
naming the first's PID and host; a dead holder never blocks; the other ranks of a torchrun job are never refused."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from lmtrain.cli import main
from lmtrain.errors import LmtrainError
from lmtrain.run_lock import LOCK_FILE, DirectoryLock, output_lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from lmtrain.run_lock import DirectoryLock
    with DirectoryLock(sys.argv[1], "lmtrain train"):
        print("LOCKED", flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def holder(tmp_path):
    """A separate process holding tmp_path/run's lock, as a running `lmtrain train` does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "LOCKED"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_second_writer_is_refused_at_once_naming_the_first(holder, tmp_path, capsys, command):
    out = tmp_path / "run"
    argv = {"train": ["train", "--data", str(tmp_path / "data"), "--out", str(out)],
            "prepare": ["prepare", "--text", str(tmp_path / "t.txt"), "--out", str(out)]}[command]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"lmtrain {command}: error: --out {out}: in use by")
    assert f"`lmtrain train` (pid {holder.pid} on host {socket.gethostname()}" in err
    assert "choose another --out" in err
    record = json.loads((out / LOCK_FILE).read_text())
    assert record["pid"] == holder.pid  # the refused command left the holder's record alone


def test_a_killed_holder_does_not_keep_the_lock(holder, tmp_path):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with DirectoryLock(tmp_path / "run", "lmtrain train") as lock:  # no wait, no stale-lock cleanup needed
        assert json.loads(lock.path.read_text())["command"] == "lmtrain train"


def test_other_ranks_of_a_job_are_not_refused(holder, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with output_lock("train", tmp_path / "run"):  # rank 1 of the job whose rank 0 holds the lock
        pass
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LmtrainError, match="in use by"), output_lock("train", tmp_path / "run"):
        pass


def test_a_directory_the_lock_made_goes_when_nothing_was_written(tmp_path):
    with DirectoryLock(tmp_path / "new", "lmtrain train"):
        assert (tmp_path / "new" / LOCK_FILE).is_file()
    assert not (tmp_path / "new").exists()
    with DirectoryLock(tmp_path / "kept", "lmtrain train"):
        (tmp_path / "kept" / "run.json").write_text("{}")
    assert (tmp_path / "kept" / LOCK_FILE).read_text() == ""  # released: the record is cleared, the file stays
    (tmp_path / "old").mkdir()
    with DirectoryLock(tmp_path / "old", "lmtrain train"):
        pass
    assert (tmp_path / "old").is_dir()  # an existing directory is never removed


def test_out_that_is_a_file_or_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(LmtrainError, match="is a file, expected a directory"), DirectoryLock(tmp_path / "f", "x"):
        pass
    with pytest.raises(LmtrainError, match="a parent of it is a file"), DirectoryLock(tmp_path / "f" / "run", "x"):
        pass
