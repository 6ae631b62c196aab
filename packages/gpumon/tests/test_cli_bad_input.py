"""Every `gpumon` subcommand and flag that takes a value, given bad values: one line, exit 2, no traceback.

Each row is argv (with {rec}-style placeholders for the files made below), the exit code and words the error line
must contain. The command runs in this process, as `python -m gpumon` would run it: an exception escaping main()
is printed as the interpreter prints it, so a traceback shows up in the output the row checks. The rows that draw
a plot run in a subprocess, so that matplotlib is never imported into the test process.
"""

import importlib.util
import os
import subprocess
import sys
import traceback

import pytest

from gpumon.cli import main
from gpumon.fake_nvml import FakeNVML
from gpumon.pollers import Poller
from gpumon.sampler import Sampler

GOOD_HEADER = '# gpumon 1 {"rate_hz": 100.0, "units": {"n.count": "count"}}\nt,kind,label,value,n.count\n'


@pytest.fixture
def files(tmp_path):
    """The files the rows name, by placeholder."""
    recording = tmp_path / "rec.csv"
    sampler = Sampler([Poller("n", "n", ["n.count"], ["count"], 0.0, lambda: [1])], out=recording, clock=lambda: 0.0)
    for k in range(5):
        sampler.sample_once(k / 100)
    sampler.stop()
    made = {
        "dir": tmp_path,
        "rec": recording,
        "missing": tmp_path / "missing.csv",
        "empty": tmp_path / "empty.csv",
        "binary": tmp_path / "binary.csv",
        "notes": tmp_path / "notes.csv",
        "bad_json": tmp_path / "bad_json.csv",
        "json_list": tmp_path / "json_list.csv",
        "zero_rate": tmp_path / "zero_rate.csv",
        "unit_list": tmp_path / "unit_list.csv",
        "no_columns": tmp_path / "no_columns.csv",
        "damaged_rows": tmp_path / "damaged_rows.csv",
        "fifo": tmp_path / "fifo.csv",
        "file_as_dir": recording / "x.csv",
        "unwritable": "/proc/gpumon-cannot-write/x.csv",
        "out_png": tmp_path / "out.png",
        "odd_format": tmp_path / "out.notaformat",
    }
    made["empty"].write_bytes(b"")
    made["binary"].write_bytes(bytes(range(256)) * 8)
    made["notes"].write_text("a,b\n1,2\n")
    made["bad_json"].write_text("# gpumon 1 {not json\nt,kind,label,value\n")
    made["json_list"].write_text("# gpumon 1 [1, 2]\nt,kind,label,value\n")
    made["zero_rate"].write_text('# gpumon 1 {"rate_hz": 0}\nt,kind,label,value\n')
    made["unit_list"].write_text('# gpumon 1 {"units": ["B"]}\nt,kind,label,value\n')
    made["no_columns"].write_text('# gpumon 1 {"rate_hz": 100}\n')
    # a valid header over rows a crash, a bad disk or another writer could leave: every bad line is skipped
    made["damaged_rows"].write_bytes(
        GOOD_HEADER.encode()
        + b"0.00,s,,,1\n0.01,s,,,\xff\xfe\n\x00\x00\x00\n0.02,s,,,2\nnan,s,,,3\ninf,s,,,3\n1e308,s,,,4\n"
        + b'0.03,s,,,"'
        + b"x" * 200_000
        + b'"\n'  # longer than the csv module's field limit
        + b"0.04,s,,,5\n0.05,mark\n0.06,s,,,1,2,3\n0.07,s,,,=\n0.08,error,n.count,\n"
        + bytes(range(1, 256))
        + b"\n0.09,s,,,1e400\n0.10,s"  # torn: the last line of a crash
    )
    os.mkfifo(made["fifo"])
    return made


ROWS = [
    # (argv, exit code, words in the error line); words are matched case-insensitively
    ([], 2, ["required", "command"]),
    (["frobnicate"], 2, ["invalid choice", "frobnicate"]),
    (["watch", "--rate", "abc"], 2, ["--rate", "'abc'", "(0, 10000] hz"]),
    (["watch", "--rate", "0"], 2, ["--rate", "'0'"]),
    (["watch", "--rate", "-5"], 2, ["--rate", "'-5'"]),
    (["watch", "--rate", "nan"], 2, ["--rate", "'nan'"]),
    (["watch", "--rate", "inf"], 2, ["--rate", "'inf'"]),
    (["watch", "--rate", "20000"], 2, ["--rate", "'20000'"]),
    (["watch", "--rate"], 2, ["--rate", "expected one argument"]),
    (["watch", "--host", "--refresh", "0"], 2, ["--refresh", "'0'", "seconds"]),
    (["watch", "--host", "--refresh", "-1"], 2, ["--refresh", "'-1'"]),
    (["watch", "--host", "--refresh", "inf"], 2, ["--refresh", "'inf'"]),
    (["watch", "--host", "--refresh", "soon"], 2, ["--refresh", "'soon'"]),
    (["watch", "--host", "--iterations", "0"], 2, ["--iterations", "whole number", "'0'"]),
    (["watch", "--host", "--iterations", "1.5"], 2, ["--iterations", "'1.5'"]),
    (["watch", "--host", "--iterations", "x"], 2, ["--iterations", "'x'"]),
    (["watch", "--colour"], 2, ["unrecognized", "--colour"]),
    (["watch", "--host", "--", "ls"], 2, ["only `record` runs a command"]),
    (["record"], 2, ["-o/--out", "--dir", "required"]),
    (["record", "-o", "{dir}"], 2, ["is a directory", "--dir"]),
    (["record", "-o", "{rec}"], 2, ["exists already", "--append", "--overwrite"]),
    (["record", "-o", "{file_as_dir}"], 2, ["cannot write", "rec.csv is a file, not a directory"]),
    (["record", "-o", "{unwritable}"], 2, ["cannot write"]),
    (["record", "--dir", "{rec}"], 2, ["cannot write", "rec.csv is a file, not a directory"]),
    (["record", "--dir", "{dir}", "--append"], 2, ["apply to -o"]),
    (["record", "-o", "{rec}", "--append", "--overwrite"], 2, ["--overwrite", "not allowed with", "--append"]),
    (["record", "-o", "{notes}", "--append"], 2, ["cannot --append", "not a gpumon recording"]),
    (["record", "-o", "{dir}/new.csv", "--rate", "0"], 2, ["--rate", "'0'"]),
    (["record", "-o", "{dir}/new.csv", "--duration", "-1"], 2, ["--duration", "'-1'"]),
    (["record", "-o", "{dir}/new.csv", "--duration", "nan"], 2, ["--duration", "'nan'"]),
    (["record", "-o", "{dir}/new.csv", "--duration", "1m"], 2, ["--duration", "'1m'"]),
    (["record", "-o", "{dir}/new.csv", "--duration", "1", "--", "true"], 2, ["--duration", "without a command"]),
    (["record", "--host", "-o", "{dir}/new.csv", "--", "/no/such/command"], 127, ["cannot run", "/no/such/command"]),
    (["summary"], 2, ["required", "file"]),
    (["summary", "{missing}"], 2, ["missing.csv", "no such recording"]),
    (["summary", "{dir}"], 2, ["is a directory"]),
    (["summary", "{fifo}"], 2, ["not a regular file"]),
    (["summary", "{empty}"], 2, ["not a gpumon recording"]),
    (["summary", "{binary}"], 2, ["not a gpumon recording"]),
    (["summary", "{notes}"], 2, ["not a gpumon recording"]),
    (["summary", "{bad_json}"], 2, ["not valid json"]),
    (["summary", "{json_list}"], 2, ["not a json object"]),
    (["summary", "{zero_rate}"], 2, ["rate_hz", "positive number"]),
    (["summary", "{unit_list}"], 2, ["units"]),
    (["summary", "{no_columns}"], 2, ["second line", "csv header"]),
    # the rows kept: t = 0.00, 0.01 (its undecodable bytes become U+FFFD text), 0.02, 1e308, 0.04, 0.07, 0.09
    (["summary", "{damaged_rows}"], 0, ["7 samples"]),
    (["summary", "--json", "{damaged_rows}"], 0, ['"samples": 7']),
    (["plot", "{missing}", "-o", "{out_png}"], 2, ["no such recording"]),
    (["plot", "{binary}", "-o", "{out_png}"], 2, ["not a gpumon recording"]),
    (["plot", "{rec}", "-o", "{dir}"], 2, ["is a directory"]),
    (["plot", "{rec}"], 2, ["-o/--out", "required"]),
]
NEEDS_MATPLOTLIB = [
    (["plot", "{rec}", "-o", "{unwritable}"], 2, ["cannot write"]),
    (["plot", "{rec}", "-o", "{odd_format}"], 2, ["cannot write", "notaformat"]),
    (["plot", "{damaged_rows}", "-o", "{out_png}"], 0, ["wrote"]),
]


def run_gpumon(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's way out
        code = exc.code
    except BaseException:  # what `python -m gpumon` would print before dying
        traceback.print_exc()
        code = None
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def check(row, files, capsys, monkeypatch, in_process=True):
    argv, code, words = row
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=False))  # record falls back to the host here
    argv = [a.format(**files) for a in argv]
    if in_process:
        got, out, err = run_gpumon(argv, capsys)
    else:
        done = subprocess.run([sys.executable, "-m", "gpumon", *argv], capture_output=True, text=True, timeout=120)
        got, out, err = done.returncode, done.stdout, done.stderr
    assert "Traceback" not in out + err, (argv, out + err)
    assert got == code, (argv, out + err)
    text = (out if code == 0 else err).lower()
    for word in words:
        assert word.lower() in text, (argv, word, out + err)
    if code != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], (argv, err)


@pytest.mark.parametrize("row", ROWS, ids=[" ".join(r[0]) or "(none)" for r in ROWS])
def test_bad_input_is_one_line_without_a_traceback(row, files, capsys, monkeypatch):
    check(row, files, capsys, monkeypatch)


@pytest.mark.parametrize("row", NEEDS_MATPLOTLIB, ids=[" ".join(r[0]) for r in NEEDS_MATPLOTLIB])
def test_bad_plot_output_is_one_line_without_a_traceback(row, files, capsys, monkeypatch):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("the plot extra is not installed")
    check(row, files, capsys, monkeypatch, in_process=False)  # matplotlib stays out of this interpreter


def test_a_refused_record_leaves_the_recording_as_it_was(files, capsys, monkeypatch):
    before = files["rec"].read_bytes()
    check((["record", "-o", "{rec}", "--duration", "0"], 2, ["exists already"]), files, capsys, monkeypatch)
    assert files["rec"].read_bytes() == before
