"""What `lmtrain prepare` and `lmtrain train` leave on disk: files others can read (the umask decides), state files
replaced atomically, and a resume that survives a half-written last line of metrics.jsonl."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from lmtrain.cli import main
from lmtrain.json_files import write_json_atomic

TRAIN = ["--preset", "tiny", "--set", "cpu_threads=1", "--set", "log_every=1", "--set", "save_every=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lmtrain.corpus import build_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    build_corpus(path, 60_000)
    path.write_text(path.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    return path


def _modes(root):
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_file_follows_the_umask(corpus, tmp_path, mask):
    old = os.umask(mask)
    try:
        assert main(["prepare", "--text", str(corpus), "--out", str(tmp_path / "data"), "--vocab-size", "400",
                     "--quiet"]) == 0  # fmt: skip
        assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), *TRAIN,
                     "--max-steps", "2"]) == 0  # fmt: skip
    finally:
        os.umask(old)
    modes = _modes(tmp_path)
    assert {"data/train.bin", "data/tokenizer.model", "data/meta.json", "run/run.json", "run/metrics.jsonl",
            "run/checkpoints/step_00000002/model.safetensors"} <= set(modes)  # fmt: skip
    want = {True: 0o777 & ~mask, False: 0o666 & ~mask}
    wrong = {p: oct(m) for p, m in modes.items() if m != want[(tmp_path / p).is_dir()]}
    assert not wrong, f"umask {oct(mask)}: expected files {oct(want[False])}, directories {oct(want[True])}"


def test_a_torn_metrics_line_does_not_stop_a_resume(corpus, tmp_path, capsys):
    assert main(["prepare", "--text", str(corpus), "--out", str(tmp_path / "data"), "--vocab-size", "400",
                 "--quiet"]) == 0  # fmt: skip
    args = ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), *TRAIN]
    assert main([*args, "--max-steps", "2"]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    torn = len(metrics.read_text().splitlines()) + 1
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 4.1, "lr"')  # the disk filled up in the middle of this record
    capsys.readouterr()
    assert main([*args, "--max-steps", "4", "--resume"]) == 0
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if "metrics.jsonl" in ln] == [
        f"trainloop: warning: {metrics}: ignored line {torn}, not a complete JSON record (cut short by a crash or a "
        "full disk?)"
    ]
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if "loss" in json.loads(ln)]
    assert steps == [1, 2, 3, 4]


def test_json_state_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    write_json_atomic(path, {"step": 1})
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        write_json_atomic(path, {"step": 2, "pad": "x" * 100_000})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind
