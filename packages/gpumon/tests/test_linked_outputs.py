"""A recording or a plot is never written through a link: an output that is a symbolic link or has other hard links
is refused in one line, whether the recording would be overwritten or appended to, and the linked file is kept."""

import importlib.util
import os
import subprocess
import sys

import pytest

from gpumon.cli import main
from gpumon.pollers import Poller
from gpumon.recording import RecordingError, RecordingWriter
from gpumon.sampler import Sampler

VICTIM = "someone else's file\n"


def _recording(path):
    sampler = Sampler([Poller("n", "n", ["n.count"], ["count"], 0.0, lambda: [1])], out=path, clock=lambda: 0.0)
    for k in range(3):
        sampler.sample_once(k / 100)
    sampler.stop()
    return path


def _symlink(target, victim):
    target.symlink_to(victim)


def _hardlink(target, victim):
    os.link(victim, target)


LINKS = [("symbolic link", _symlink), ("hard link", _hardlink)]


@pytest.mark.parametrize("if_exists", ["overwrite", "append", "error"])
@pytest.mark.parametrize("make", [k[1] for k in LINKS], ids=[k[0] for k in LINKS])
def test_the_recording_writer_refuses_a_linked_file(tmp_path, make, if_exists):
    victim = _recording(tmp_path / "theirs.csv")  # a real recording, so that "append" would accept its columns
    kept = victim.read_bytes()
    make(tmp_path / "gpu.csv", victim)
    with pytest.raises((RecordingError, FileExistsError)) as info:
        RecordingWriter(tmp_path / "gpu.csv", ["n.count"], {"rate_hz": 100.0}, if_exists=if_exists)
    assert len(str(info.value).splitlines()) == 1
    assert victim.read_bytes() == kept


@pytest.mark.parametrize("flag", ["--overwrite", "--append"])
@pytest.mark.parametrize("make", [k[1] for k in LINKS], ids=[k[0] for k in LINKS])
def test_record_refuses_a_linked_output(tmp_path, capsys, make, flag):
    victim = _recording(tmp_path / "theirs.csv")
    kept = victim.read_bytes()
    make(tmp_path / "gpu.csv", victim)
    assert main(["record", "--host", "-o", str(tmp_path / "gpu.csv"), flag, "--duration", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "remove it" in err[0], err
    assert victim.read_bytes() == kept


PLOT = """
import sys
from gpumon.cli import main
sys.exit(main(["plot", sys.argv[1], "-o", sys.argv[2]]))
"""


@pytest.mark.parametrize("make", [k[1] for k in LINKS], ids=[k[0] for k in LINKS])
def test_plot_refuses_a_linked_output(tmp_path, make):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("plotting needs matplotlib (the plot extra)")
    rec = _recording(tmp_path / "rec.csv")
    victim = tmp_path / "theirs.png"
    victim.write_text(VICTIM)
    make(tmp_path / "out.png", victim)
    proc = subprocess.run([sys.executable, "-c", PLOT, str(rec), str(tmp_path / "out.png")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "out.png: " in proc.stderr and "remove it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert victim.read_text() == VICTIM
