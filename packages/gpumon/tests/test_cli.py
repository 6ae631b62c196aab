"""The `gpumon` command in a subprocess, where there really is no NVIDIA driver."""

import importlib.metadata
import os
import pty
import subprocess
import sys
from datetime import datetime

import pytest
from nvml_driver import driver_present

NO_DRIVER = not driver_present()
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is present here")


def gpumon(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True, text=True, timeout=timeout)


def test_entry_point_is_declared():
    (ep,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "gpumon"]
    assert ep.value == "gpumon.cli:main"


@needs_no_driver
def test_watch_without_driver_prints_one_line_and_exits_2():
    result = gpumon("watch")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--host" in lines[0] and "driver" in lines[0]


def test_watch_into_a_log_prints_timestamped_lines():
    result = gpumon("watch", "--host", "--iterations", "2", "--refresh", "0.1")  # stdout is a pipe here
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\r" not in result.stdout
    lines = result.stdout.splitlines()
    assert len(lines) == 4  # per refresh: the host, then the sampler
    for line in lines:
        datetime.fromisoformat(line.split(" ", 1)[0])  # each line starts with its time
    assert [line.split()[1] for line in lines] == ["host", "gpumon", "host", "gpumon"]
    assert "tree_rss=" in lines[0] and "GiB" in lines[0] and "rate=" in lines[1]


def watch_on_a_terminal(*flags, env=None):
    """`gpumon watch --host` with stdout on a pseudo-terminal; what it wrote there."""
    leader, follower = pty.openpty()
    env = {**os.environ, **(env or {})}
    args = [sys.executable, "-m", "gpumon", "watch", "--host", "--iterations", "2", "--refresh", "0.1", *flags]
    proc = subprocess.Popen(args, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal is closed once the command has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    return b"".join(chunks).decode()


@pytest.mark.parametrize(
    ("flags", "env", "live"),
    [
        ((), {"TQDM_DISABLE": ""}, True),
        (("--no-progress",), {"TQDM_DISABLE": ""}, False),
        ((), {"TQDM_DISABLE": "1"}, False),
    ],
)
def test_watch_redraws_in_place_only_on_a_terminal_that_asks_for_it(flags, env, live):
    shown = watch_on_a_terminal(*flags, env=env)
    assert ("\x1b[H\x1b[2J" in shown) is live
    assert shown.count("gpumon watch") == (2 if live else 0) and "tree_rss" in shown


@needs_no_driver
def test_record_passes_the_exit_code_through_and_falls_back_to_host(tmp_path):
    out = tmp_path / "rec.csv"
    result = gpumon(
        "record", "-o", str(out), "--", sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "warning" in result.stderr and "host only" in result.stderr
    assert "samples" in result.stderr  # the summary
    summary = gpumon("summary", str(out))
    assert summary.returncode == 0 and "host.tree_rss_bytes" in summary.stdout
    as_json = gpumon("summary", "--json", str(out))
    assert as_json.returncode == 0 and '"achieved_rate_hz"' in as_json.stdout
    png = tmp_path / "rec.png"
    plot = gpumon("plot", str(out), "-o", str(png))
    assert plot.returncode == 0, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_record_reports_a_signal_as_128_plus_n(tmp_path):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    result = gpumon("record", "--host", "-o", str(tmp_path / "r.csv"), "--", sys.executable, "-c", code)
    assert result.returncode == 128 + 15


def test_record_of_a_missing_command_exits_127(tmp_path):
    result = gpumon("record", "--host", "-o", str(tmp_path / "r.csv"), "--", "no-such-command-gpumon")
    assert result.returncode == 127 and "Traceback" not in result.stderr


def test_summary_of_a_bad_file_exits_2(tmp_path):
    missing = gpumon("summary", str(tmp_path / "nope.csv"))
    assert missing.returncode == 2 and "no such recording" in missing.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    result = gpumon("summary", str(bad))
    assert result.returncode == 2 and "not a gpumon recording" in result.stderr and "Traceback" not in result.stderr


def test_record_without_command_stops_on_sigterm_and_finishes_the_file(tmp_path):
    import signal
    import time

    out = tmp_path / "r.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumon", "record", "--host", "-o", str(out)], stderr=subprocess.PIPE, text=True
    )
    # Rows reach the disk with the first flush, a second after the start and after the handler is installed: the
    # signal goes only once they are there, however slowly a loaded machine starts the command.
    deadline = time.monotonic() + 300
    while not out.exists() or out.read_text().count("\n") < 3:
        assert time.monotonic() < deadline and proc.poll() is None, f"no rows in {out}: {proc.stderr.read()}"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in stderr
    assert out.read_text().rstrip().splitlines()[-1].startswith("# end ")
