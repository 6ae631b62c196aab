"""Someone else's run directory cannot make a run write where it should not: a member that is a symbolic link to a
file or directory outside it is refused in one line before anything is written, and the file it points to is left
byte for byte as it was (checked by hashing a decoy). Links that stay inside the run directory are fine."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from trained_runs import tiny_run

from lmtrain.cli import main

DECOY_TEXT = "the user's own file, which no run may touch\n" * 50


def _digest(path) -> str:
    if path.is_dir():
        return hashlib.sha256("".join(sorted(str(p.relative_to(path)) for p in path.rglob("*"))).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def run_copy(tmp_path_factory, tmp_path):
    """A copy of a trained run, and a way to train it on the run's own data."""
    source = tiny_run(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    data = json.loads((source / "run.json").read_text())["data"]

    def train(*flags):
        return main(["train", "--data", data, "--out", str(run), "--preset", "tiny", "--max-steps", "6", "--set",
                     "cpu_threads=1", *flags])  # fmt: skip

    return run, train


@pytest.mark.parametrize(
    "member",
    [
        ".lmtrain.lock",
        "tokenizer.model",
        "loss.png",
        "metrics.jsonl",
        "run.json",
        "summary.json",
        "checkpoints",
        "checkpoints/best.json",
        "checkpoints/.tmp-step_00000006",
    ],  # fmt: skip
)
@pytest.mark.parametrize("how", ["--resume", "--overwrite"])
def test_a_link_to_outside_is_refused_and_its_target_untouched(run_copy, tmp_path, capsys, member, how):
    run, train = run_copy
    outside = tmp_path / "outside"
    outside.mkdir()
    decoy = outside / ("decoy_dir" if member in ("checkpoints", "checkpoints/.tmp-step_00000006") else "decoy.txt")
    if decoy.suffix:
        decoy.write_text(DECOY_TEXT)
    else:
        decoy.mkdir()
        (decoy / "kept.txt").write_text(DECOY_TEXT)
    before = _digest(decoy)
    link = run / member
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    os.symlink(decoy, link)  # for "checkpoints": in place of the whole directory
    capsys.readouterr()
    code = train(how)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "symbolic link" in err, err
    assert _digest(decoy) == before and sorted(p.name for p in outside.iterdir()) == [decoy.name]


def test_links_that_stay_inside_are_fine(run_copy, capsys):
    run, train = run_copy
    os.symlink("metrics.jsonl", run / "metrics-latest.jsonl")  # a convenience link a user made
    assert train("--resume") == 0, capsys.readouterr().err


@pytest.mark.parametrize("record", ["in the checkpoint", "in run.json alone"])
def test_a_tokenizer_that_is_not_the_weights_is_refused(run_copy, tmp_path, capsys, record):
    run, train = run_copy
    if record == "in run.json alone":  # extra_state.json removed and each manifest made to agree again
        for ckpt in (run / "checkpoints").glob("step_*"):
            (ckpt / "extra_state.json").unlink()
            manifest = json.loads((ckpt / "manifest.json").read_text())
            del manifest["files"]["extra_state.json"]
            for rel in manifest["files"]:
                data = (ckpt / rel).read_bytes()
                manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            (ckpt / "manifest.json").write_text(json.dumps(manifest))
    sp_model = run / "tokenizer.model"
    swapped = bytearray(sp_model.read_bytes())
    swapped[-1] ^= 0x01  # another tokenizer of the same size
    sp_model.write_bytes(bytes(swapped))
    text = tmp_path / "t.txt"
    text.write_text("def main():\n    return 0\n")
    for argv in (["eval", "--run", str(run), "--text", str(text)], ["generate", "--run", str(run), "--prompt", "def"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is not the tokenizer" in err and err.count("sha256") == 2, err


def test_resuming_on_data_with_another_tokenizer_is_refused_before_anything_changes(run_copy, tmp_path, capsys):
    from lmtrain.corpus import build_corpus
    from lmtrain.prepare_data import prepare

    run, _ = run_copy
    text = tmp_path / "other.txt"
    build_corpus(text, 80_000)
    other = tmp_path / "other-data"
    prepare([text], other, vocab_size=400, progress=False)  # the same size, other pieces
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    capsys.readouterr()
    code = main(["train", "--data", str(other), "--out", str(run), "--resume", "--set", "cpu_threads=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is not the one" in err and err.count("sha256") == 2, err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
