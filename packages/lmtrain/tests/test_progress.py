"""Progress on every long step: a bar on a terminal, timestamped lines elsewhere (a log, a pipe, --no-progress)."""

import io
import re

from trained_runs import tiny_run

from lmtrain.cli import main
from lmtrain.progress import Progress, step

STAMP = re.compile(r"^\[lmtrain \d\d:\d\d:\d\d\] ")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_off_a_terminal_a_bar_on_one(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    log = io.StringIO()
    with Progress("eval", total=3, unit="batches", stream=log, every_s=0.0) as progress:
        for _ in range(3):
            progress.update()
    lines = log.getvalue().splitlines()
    assert all(STAMP.match(line) for line in lines) and len(lines) == 5, lines  # start, 3 updates, done
    assert "eval: started (3 batches)" in lines[0] and "(33%)" in lines[1] and "eval: done, 3 batches" in lines[-1]
    tty = Terminal()
    with Progress("eval", total=3, unit="batches", stream=tty) as progress:
        progress.update(3)
    assert "[lmtrain" not in tty.getvalue() and "3/3" in tty.getvalue()  # tqdm's bar
    monkeypatch.setenv("TQDM_DISABLE", "1")  # --no-progress: lines on a terminal too
    with step("tokenizer: training", stream=tty) as bar:
        assert bar is False
    assert STAMP.match(tty.getvalue().splitlines()[-1])


def test_eval_and_prepare_say_what_they_do_when_not_on_a_terminal(tmp_path_factory, tmp_path, capsys):
    run = tiny_run(tmp_path_factory)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--text", str(run.parent / "data" / "val.txt")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(STAMP.match(line) and "eval (" in line and "started" in line for line in err), err
    assert any(STAMP.match(line) and "batches in" in line for line in err), err
    assert main(["prepare", "--text", str(run.parent / "input.txt"), "--out", str(tmp_path / "d"),
                 "--vocab-size", "400"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert re.search(r"\] tokenizer: training bpe \(vocab 400\) on .* MB: done in", err), err
    assert re.search(r"\] encode: the training split -> .*train.bin: done in", err), err


def test_export_says_each_long_step(tmp_path_factory, tmp_path, capsys):
    import pytest

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    run = tiny_run(tmp_path_factory)
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"\] export: the tokenizer converted and checked against SentencePiece: done in", err), err
    assert re.search(r"\] export: the weights \(mpt layout\) -> .*hf: done in", err), err
