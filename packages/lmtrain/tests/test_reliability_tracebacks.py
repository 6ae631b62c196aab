"""Inputs and faults that ended in a traceback, or in a silent success, now end in one line with exit status 2: a
damaged .zst corpus, the file size limit (ulimit -f) during prepare and train, a pickle in place of a checkpoint's
weights, a meta.json bytes_per_token that is no number, a GGUF export cut short by a full disk, JSON nested too
deeply, a non-finite --lora-alpha. A fine-tune's adapters follow the umask and record their base."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from safetensors import safe_open
from trained_runs import tiny_run

from lmtrain.cli import main
from lmtrain.errors import LmtrainError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def _one_line(capsys, argv, *words):
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"lmtrain {argv[0]}: error: "), (code, err)
    assert all(w in err[0] for w in words), err[0]
    return err[0]


def _chat(path):
    rows = [{"prompt": f"def f{i}(x):\n", "response": f"    return {i} * x\n"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rehash(ckpt):
    """The checkpoint's manifest made to agree with its files, as whoever swapped a file would."""
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel in manifest["files"]:
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("cut", ["truncated", "header zeroed"])
def test_prepare_on_a_damaged_zst_corpus_is_one_line(run, tmp_path, capsys, cut):
    pa = pytest.importorskip("pyarrow", reason="zstd input is read through pyarrow (the parquet extra)")
    zst = tmp_path / "corpus.txt.zst"
    with pa.output_stream(str(zst), compression="zstd") as f:
        f.write((run.parent / "input.txt").read_bytes())
    packed = zst.read_bytes()
    zst.write_bytes(packed[: len(packed) // 2] if cut == "truncated" else packed[:6] + bytes(54) + packed[60:])
    argv = ["prepare", "--text", str(zst), "--out", str(tmp_path / "data"), "--vocab-size", "400", "--quiet"]
    _one_line(capsys, argv, "corpus.txt.zst: damaged zstd data", "compress it again")
    assert not (tmp_path / "data").exists()


def test_resume_on_a_pickle_in_place_of_the_weights_is_one_line(run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    for ckpt in (out / "checkpoints").glob("step_*"):
        (ckpt / "model.safetensors").write_bytes(pickle.dumps({"weight": [1.0]}))
        _rehash(ckpt)
    argv = ["train", "--config", str(run / "run.json"), "--out", str(out), "--resume", "--max-steps", "6",
            "--no-progress"]  # fmt: skip
    _one_line(capsys, argv, "model.safetensors: refused to load (not a safetensors file")


def test_a_bytes_per_token_that_is_no_number_is_one_line(run, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(run.parent / "data", data)
    meta = json.loads((data / "meta.json").read_text())
    for section in (meta, meta["train"], meta["val"]):
        section["bytes_per_token"] = "x"
    (data / "meta.json").write_text(json.dumps(meta))
    argv = ["train", "--config", str(run / "run.json"), "--data", str(data), "--out", str(tmp_path / "run"),
            "--max-steps", "1", "--no-progress"]  # fmt: skip
    _one_line(capsys, argv, "bytes_per_token: expected a finite number > 0, found 'x'")


LIMITED = """
import resource, sys
from lmtrain.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
sys.exit(main(sys.argv[1:]))
"""


def _limited(argv, limit):
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(LIMITED.format(limit=limit)), *argv], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_the_file_size_limit_during_prepare_is_one_line(run, tmp_path):
    argv = ["prepare", "--text", str(run.parent / "input.txt"), "--out", str(tmp_path / "data"), "--vocab-size",
            "400", "--quiet"]  # fmt: skip
    proc = _limited(argv, 8192)
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "file too large" in errors[0] and "8,192 bytes (ulimit -f)" in errors[0], errors[0]


def test_the_file_size_limit_during_a_save_is_one_line(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    argv = ["train", "--config", str(run / "run.json"), "--out", str(out), "--resume", "--max-steps", "6",
            "--no-progress"]  # fmt: skip
    proc = _limited(argv, 65536)  # the checkpoints already there are larger; the new one's weights do not fit
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("lmtrain train: error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "file too large writing" in errors[0] and "ulimit -f" in errors[0], errors[0]


def test_a_gguf_export_cut_short_by_a_full_disk_is_one_line(run, tmp_path, capsys, monkeypatch):
    gguf = pytest.importorskip("gguf")

    def full_disk(self, *args, **kwargs):
        raise OSError("25600 requested and 15488 written")  # numpy's tofile on a full disk: no errno

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    out = tmp_path / "m.gguf"
    _one_line(capsys, ["export", "--run", str(run), "--format", "gguf", "--out", str(out)],
              "no space left on device writing", "m.gguf")  # fmt: skip
    assert not out.exists() and list(tmp_path.iterdir()) == []


NESTED = [
    ("brackets", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("braces", '{"a": ' * 50_000 + "1" + "}" * 50_000),
]


@pytest.mark.parametrize("line", [n[1] for n in NESTED], ids=[n[0] for n in NESTED])
def test_json_nested_too_deeply_is_one_line(line):
    from lmtrain.text_codec import load_json_line

    with pytest.raises(LmtrainError, match="chat.jsonl line 3: expected a JSON object, found JSON nested deeper"):
        load_json_line(line, "chat.jsonl line 3")


def test_a_finetune_line_nested_too_deeply_is_one_line(run, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "q", "response": "a"}\n' + NESTED[0][1] + "\n")
    argv = ["finetune", "--from", str(run), "--data", str(data), "--out", str(tmp_path / "ft"), "--max-steps", "1"]
    _one_line(capsys, argv, "chat.jsonl line 2", "nested deeper")


@pytest.mark.parametrize("alpha", ["nan", "inf", "-16"])
def test_a_lora_alpha_that_is_no_finite_positive_number_is_one_line(run, tmp_path, capsys, alpha):
    data = tmp_path / "chat.jsonl"
    _chat(data)
    argv = ["finetune", "--from", str(run), "--data", str(data), "--out", str(tmp_path / "ft"), "--max-steps", "1",
            "--lora-alpha", alpha, "--no-progress"]  # fmt: skip
    _one_line(capsys, argv, "--lora-alpha", "expected a finite number > 0")
    assert not (tmp_path / "ft" / "adapters.safetensors").exists()


def test_finetuned_adapters_follow_the_umask_and_record_their_base(run, tmp_path):
    from lmcore import GPT
    from lmcore.lora import base_fingerprint
    from lmtrain.finetune_run import finetune

    data = tmp_path / "chat.jsonl"
    _chat(data)
    old = os.umask(0o022)
    try:
        finetune(f"{run}:latest", data, tmp_path / "ft", max_steps=1, lora_r=2, seq_len=64,
                 overrides={"micro_batch": 2}, quiet=True)  # fmt: skip
    finally:
        os.umask(old)
    adapters = tmp_path / "ft" / "adapters.safetensors"
    assert stat.S_IMODE(adapters.stat().st_mode) == 0o644
    with safe_open(str(adapters), framework="pt") as f:
        recorded = f.metadata()["lora_base_sha256"]
    latest = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert recorded == base_fingerprint(GPT.from_pretrained(latest))
