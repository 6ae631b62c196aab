"""Every bad input to every `lmtrain` subcommand is one line on stderr, `lmtrain <command>: error: ...`, exit 2.

One table for all of them: the arguments (with placeholders for the files a row prepares), the exit code, the words
the line must hold. Rows that need a damaged file build it from the module's prepared data or trained run. The
disk-full rows make one write raise the OSError a full disk raises (ENOSPC), in process.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from lmtrain.cli import main
from lmtrain.run_lock import DirectoryLock

TRAIN = ["--preset", "tiny", "--max-steps", "2", "--set", "cpu_threads=1", "--set", "log_every=1"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A prepared data directory and a run trained on it for two steps (a checkpoint with model.safetensors)."""
    from lmtrain.corpus import build_corpus
    from lmtrain.prepare_data import prepare

    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus.txt"
    build_corpus(corpus, 60_000)
    corpus.write_text(corpus.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    prepare([str(corpus)], root / "data", vocab_size=400, progress=False)
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"), *TRAIN]) == 0
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lmtrain*"))
    return dst


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


# Each setup gets (tmp_path, made, monkeypatch, stack) and returns extra placeholders for the row's arguments.
def _a_file(tmp, made, mp, stack):
    (tmp / "file").write_text("not a directory")
    return {}


def _locked(tmp, made, mp, stack):
    lock = DirectoryLock(tmp / "busy", "lmtrain train")
    lock.__enter__()
    stack.append(lock.release)
    return {}


def _run_copy(tmp, made, mp, stack):
    _copy(made / "run", tmp / "run")
    return {}


def _data_copy(tmp, made, mp, stack):
    _copy(made / "data", tmp / "data")
    return {}


def _run_json_garbage(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    (tmp / "run" / "run.json").write_text('{"model_config": {')
    return {}


def _run_json_wrong_types(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    _edit_json(tmp / "run" / "run.json", lambda d: d.update(model_config=3, train_config="fast"))
    return {}


def _meta_garbage(tmp, made, mp, stack):
    _data_copy(tmp, made, mp, stack)
    (tmp / "data" / "meta.json").write_bytes(b"\x00\x01 not json")
    return {}


def _meta_wrong_types(tmp, made, mp, stack):
    _data_copy(tmp, made, mp, stack)
    _edit_json(tmp / "data" / "meta.json", lambda d: d.update(vocab_size="many"))
    return {}


def _meta_small_vocab(tmp, made, mp, stack):
    # meta.json says 300, the token files' headers 400: the model would be built with 300 embeddings.
    _data_copy(tmp, made, mp, stack)
    _edit_json(tmp / "data" / "meta.json", lambda d: d.update(vocab_size=300))
    return {}


def _flipped_byte(tmp, made, mp, stack):
    _data_copy(tmp, made, mp, stack)
    path = tmp / "data" / "train.bin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one token: size and header still fine
    path.write_bytes(bytes(raw))
    return {}


def _flipped_checkpoint_byte(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    for weights in (tmp / "run" / "checkpoints").glob("step_*/model.safetensors"):
        raw = bytearray(weights.read_bytes())
        raw[len(raw) // 2] ^= 0x01  # one bit of one weight: the size, the header and the file's shape still fine
        weights.write_bytes(bytes(raw))
    return {}


def _full_at_checkpoint(tmp, made, mp, stack):
    import trainloop.engine_torch as engine_torch

    mp.setattr(engine_torch, "save_torch", _no_space)
    return {}


class _FullFile:
    """A file whose writes fail as they do on a full disk."""

    def __init__(self, path, mode):
        self._f = open(path, mode)  # noqa: SIM115 - closed in __exit__

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def _full_at_run_json(tmp, made, mp, stack):
    import trainloop.checkpoint as checkpoint

    real = checkpoint.open_new

    # What writes the state files (never through a link): only the writes of run.json find the disk full.
    def full_at_run_json(path, mode="w"):
        return _FullFile(path, mode) if "run.json" in str(path) else real(path, mode)

    mp.setattr(checkpoint, "open_new", full_at_run_json)
    return {}


class _FillingFile:
    """A file on a disk with 700 bytes left: a write that does not fit raises ENOSPC, as write() does."""

    def __init__(self, f):
        self._f, self._room = f, 700

    def write(self, data):
        if memoryview(data).nbytes > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= memoryview(data).nbytes
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _full_inside_torch_save(tmp, made, mp, stack):
    import trainloop.checkpoint as checkpoint

    real = checkpoint.open_new

    # The state files' torch.save (a real one): torch's zip writer raises its own error over the write's ENOSPC.
    def filling(path, mode="w"):
        f = real(path, mode)
        return _FillingFile(f) if str(path).endswith(".pt") else f

    mp.setattr(checkpoint, "open_new", filling)
    return {}


def _full_at_token_file(tmp, made, mp, stack):
    import tokbin.writer

    mp.setattr(tokbin.writer.os, "fsync", _no_space)
    return {}


def _nan_weights(tmp, made, mp, stack):
    from safetensors.torch import load_file, save_file

    _run_copy(tmp, made, mp, stack)
    for ckpt in (tmp / "run" / "checkpoints").glob("step_*"):
        weights = ckpt / "model.safetensors"
        state = {k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}
        save_file(state, weights, metadata={"format": "pt"})
    return {}


def _rehash(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest for its files as they now are: a damage the size check cannot see."""
    files = {str(p.relative_to(ckpt)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
             for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}  # fmt: skip
    _edit_json(ckpt / "manifest.json", lambda m: m.update(files=files))


def _change_checkpoints(tmp, made, mp, change):
    _run_copy(tmp, made, mp, [])
    for ckpt in (tmp / "run" / "checkpoints").glob("step_*"):
        change(ckpt)
        _rehash(ckpt)


def _pickle_weights(tmp, made, mp, stack):
    _change_checkpoints(tmp, made, mp, lambda c: torch.save({"w": torch.zeros(2)}, c / "model.safetensors"))
    return {}


def _rewrite_weights(change, metadata=None):
    from safetensors.torch import load_file, save_file

    def rewrite(ckpt):
        state = load_file(ckpt / "model.safetensors")
        save_file(change(state), ckpt / "model.safetensors", metadata=metadata or {"format": "pt"})

    return rewrite


def _int64_weights(tmp, made, mp, stack):
    _change_checkpoints(tmp, made, mp, _rewrite_weights(lambda s: {k: v.long() for k, v in s.items()}))
    return {}


def _wrong_shape_no_config(tmp, made, mp, stack):
    # A checkpoint without its own config.json is built from run.json's model config.
    def change(ckpt):
        (ckpt / "config.json").unlink()
        _rewrite_weights(lambda s: {**s, "norm.weight": torch.ones(3)})(ckpt)

    _change_checkpoints(tmp, made, mp, change)
    return {}


def _lora_settings_lacking_fields(tmp, made, mp, stack):
    _change_checkpoints(tmp, made, mp, _rewrite_weights(lambda s: s, {"format": "pt", "lora_settings": '{"r": 4}'}))
    return {}


def _lora_file_lacking_fields(tmp, made, mp, stack):
    from safetensors.torch import save_file

    _run_copy(tmp, made, mp, stack)
    save_file({"layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 64)}, tmp / "lora.safetensors",
              metadata={"lora_settings": '{"targets": ["q_proj"], "r": 4}'})  # fmt: skip
    return {}


def _config_of_2000_layers(tmp, made, mp, stack):
    import types

    import psutil

    _change_checkpoints(tmp, made, mp, lambda c: _edit_json(c / "config.json", lambda d: d.update(n_layer=2000)))
    # 2000 tiny layers would fit here (0.4 GB): the host is made to have less, so that nothing big is ever built.
    mp.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=100 * 2**20))
    return {}


def _run_json_eos_id_text(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    _edit_json(tmp / "run" / "run.json", lambda d: d.update(eos_id="2"))
    return {}


def _run_json_seq_len_text(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    _edit_json(tmp / "run" / "run.json", lambda d: d["data_config"].update(seq_len="long"))
    return {}


def _no_triton_interpreter(tmp, made, mp, stack):
    mp.setenv("TRITON_INTERPRET", "0")  # the CPU cannot run the Triton kernels outside the interpreter
    return {}


def _triton_checkpoint(tmp, made, mp, stack):
    _run_copy(tmp, made, mp, stack)
    for config in (tmp / "run" / "checkpoints").glob("step_*/config.json"):
        _edit_json(config, lambda c: c.update(attention_backend="triton"))
        entry = {"sha256": hashlib.sha256(config.read_bytes()).hexdigest(), "bytes": config.stat().st_size}
        _edit_json(config.with_name("manifest.json"), lambda m, e=entry: m["files"].update({"config.json": e}))
    return _no_triton_interpreter(tmp, made, mp, stack)


def _file_and_run(tmp, made, mp, stack):
    _a_file(tmp, made, mp, stack)
    return _run_copy(tmp, made, mp, stack)


def _no_deepspeed(tmp, made, mp, stack):
    import sys

    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        mp.delitem(sys.modules, name)
    mp.setitem(sys.modules, "deepspeed", None)  # as if the deepspeed extra were not installed
    (tmp / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    return {}


def _binary_configs(tmp, made, mp, stack):
    for name in ("config.json", "ds.json"):
        (tmp / name).write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    return {}


def _ds_top_level_typo(tmp, made, mp, stack):
    # The known keys are read off DeepSpeed's own parser: without the extra a --deepspeed run is refused earlier.
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    (tmp / "ds.json").write_text('{"trian_batch_size": 8, "zero_optimization": {"stage": 2}}')
    return {}


def _hostfile_binary(tmp, made, mp, stack):
    (tmp / "hosts").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    return {}


def _hostfile_bad_slots(tmp, made, mp, stack):
    (tmp / "hosts").write_text("node1 slots=four\n")
    return {}


P = ["prepare", "--text", "{corpus}", "--vocab-size", "400", "--quiet"]
T = ["train", "--data", "{data}", *TRAIN]
R = ["--run", "{tmp}/run"]
ROWS = [
    # prepare
    ("prepare --out a file", [*P, "--out", "{tmp}/file"], _a_file, ["--out", "/file", "is a file"]),
    ("prepare --out in use", [*P, "--out", "{tmp}/busy"], _locked, ["in use by", "{pid}", "{host}"]),
    ("prepare --workers 0", [*P, "--out", "{tmp}/o", "--workers", "0"], None, ["--workers", "0"]),
    ("prepare --tokenizer-sample-mb nan", [*P, "--out", "{tmp}/o", "--tokenizer-sample-mb", "nan"], None,
     ["--tokenizer-sample-mb", "nan"]),
    ("prepare --shard-mb nan", [*P, "--out", "{tmp}/o", "--shard-mb", "nan"], None, ["--shard-mb", "nan"]),
    ("prepare disk full", [*P, "--out", "{tmp}/o"], _full_at_token_file, ["No space left on device", "{tmp}/o"]),
    # train
    ("train --out a file", [*T, "--out", "{tmp}/file"], _a_file, ["--out", "/file", "is a file"]),
    ("train --out in use", [*T, "--out", "{tmp}/busy"], _locked, ["in use by", "{pid}", "{host}", "lmtrain train"]),
    ("train triton on cpu", [*T, "--out", "{tmp}/r", "--set", "attention_backend=triton"], _no_triton_interpreter,
     ["attention_backend='triton'", "cpu", "attention_backend=auto"]),
    ("train --max-steps 0", [*T, "--out", "{tmp}/r", "--max-steps", "0"], None, ["--max-steps 0", ">= 1"]),
    ("train --set seed=1e20", [*T, "--out", "{tmp}/r", "--set", "seed=1e20"], None, ["seed", "below 2**32"]),
    ("train --out ''", [*T, "--out", ""], None, ["--out ''", "expected a run directory"]),
    ("train --time-budget 0", [*T, "--out", "{tmp}/r", "--time-budget", "0"], None, ["time_budget", "> 0"]),
    ("train --time-budget nan", [*T, "--out", "{tmp}/r", "--time-budget", "nan"], None, ["time_budget", "finite"]),
    ("train run.json not JSON", [*T, "--out", "{tmp}/run", "--resume"], _run_json_garbage, ["run.json", "unreadable"]),
    ("train run.json wrong types", [*T, "--out", "{tmp}/run", "--resume"], _run_json_wrong_types,
     ["run.json", "model_config"]),
    ("train meta.json not JSON", ["train", "--data", "{tmp}/data", *TRAIN, "--out", "{tmp}/r"], _meta_garbage,
     ["meta.json"]),
    ("train meta.json wrong types", ["train", "--data", "{tmp}/data", *TRAIN, "--out", "{tmp}/r"],
     _meta_wrong_types, ["meta.json", "vocab_size", "many"]),
    ("train header vocab above the model's", ["train", "--data", "{tmp}/data", *TRAIN, "--out", "{tmp}/r"],
     _meta_small_vocab, ["train.bin", "vocab_size 400", "the model's vocab_size is 300", "--set vocab_size=400"]),
    ("train damaged token file", ["train", "--data", "{tmp}/data", *TRAIN, "--out", "{tmp}/r"], _flipped_byte,
     ["train.bin", "checksum mismatch", "lmtrain prepare"]),
    ("train disk full at a checkpoint", [*T, "--out", "{tmp}/r"], _full_at_checkpoint,
     ["no space left on device", "{tmp}/r/checkpoints/.tmp-step_00000002", "a checkpoint of this run takes about"]),
    ("train disk full inside torch.save", [*T, "--out", "{tmp}/r"], _full_inside_torch_save,
     ["no space left on device", "{tmp}/r/checkpoints/.tmp-step_00000002", "a checkpoint of this run takes about"]),
    ("train --deepspeed without the extra", [*T, "--out", "{tmp}/r", "--deepspeed", "{tmp}/ds.json"], _no_deepspeed,
     ["needs deepspeed", "[deepspeed]"]),
    ("train --model-config binary", ["train", "--data", "{data}", "--out", "{tmp}/r", "--model-config",
     "{tmp}/config.json"], _binary_configs, ["--model-config {tmp}/config.json", "can't decode byte 0x89"]),
    ("train --deepspeed binary", [*T, "--out", "{tmp}/r", "--deepspeed", "{tmp}/ds.json"], _binary_configs,
     ["DeepSpeed config {tmp}/ds.json", "not UTF-8 text", "a binary file?"]),
    ("train --deepspeed top-level typo", [*T, "--out", "{tmp}/r", "--deepspeed", "{tmp}/ds.json"], _ds_top_level_typo,
     ["unknown top-level key 'trian_batch_size'", "did you mean 'train_batch_size'"]),
    ("train disk full at run.json", [*T, "--out", "{tmp}/r"], _full_at_run_json,
     ["{tmp}/r/run.json", "No space left on device"]),
    # eval
    ("eval triton on cpu", ["eval", *R, "--text", "{corpus}"], _triton_checkpoint, ["attention_backend='triton'"]),
    ("eval --context 0", ["eval", *R, "--text", "{corpus}", "--context", "0"], _run_copy, ["context", "0"]),
    ("eval --stride 0", ["eval", *R, "--text", "{corpus}", "--stride", "0"], _run_copy, ["stride", "0"]),
    ("eval --run missing", ["eval", "--run", "{tmp}/none", "--text", "{corpus}"], None, ["{tmp}/none", "run.json"]),
    ("eval --text missing", ["eval", *R, "--text", "{tmp}/none.txt"], _run_copy, ["none.txt"]),
    ("eval run.json wrong types", ["eval", *R, "--text", "{corpus}"], _run_json_wrong_types, ["run.json"]),
    ("eval --checkpoint 999", ["eval", *R, "--text", "{corpus}", "--checkpoint", "999"], _run_copy, ["999"]),
    ("eval --verify full, a flipped byte", ["eval", *R, "--text", "{corpus}", "--verify", "full"],
     _flipped_checkpoint_byte, ["step_00000002", "SHA-256 mismatch in model.safetensors"]),
    ("eval NaN weights", ["eval", *R, "--text", "{corpus}"], _nan_weights,
     ["step_00000002", "NaN or inf", "loss nan", "an earlier checkpoint with --checkpoint"]),
    ("eval --json NaN weights", ["eval", *R, "--text", "{corpus}", "--json"], _nan_weights, ["NaN or inf"]),
    ("eval pickle as model.safetensors", ["eval", *R, "--text", "{corpus}"], _pickle_weights,
     ["step_00000002/model.safetensors", "not a readable safetensors file"]),
    ("eval int64 weights", ["eval", *R, "--text", "{corpus}"], _int64_weights,
     ["model.safetensors", "is int64, expected a floating-point tensor"]),
    ("eval wrong-shaped weights, no config.json", ["eval", *R, "--text", "{corpus}"], _wrong_shape_no_config,
     ["model.safetensors: norm.weight is float32 (3,)", "the run's model config has float32 (64,)"]),
    ("eval lora_settings lacking fields", ["eval", *R, "--text", "{corpus}"], _lora_settings_lacking_fields,
     ["model.safetensors", "lora_settings metadata lacks targets, alpha, dropout"]),
    ("eval run.json eos_id a string", ["eval", *R, "--text", "{corpus}"], _run_json_eos_id_text,
     ["run.json", "eos_id='2'", "an integer"]),
    ("eval run.json seq_len a string", ["eval", *R, "--text", "{corpus}"], _run_json_seq_len_text,
     ["run.json", "data_config.seq_len='long'"]),
    ("eval a config of 2000 layers", ["eval", *R, "--text", "{corpus}"], _config_of_2000_layers,
     ["step_00000002", "n_layer=2000", "GiB of host memory to load, 0.1 GiB is available"]),
    # generate
    ("generate --temperature nan", ["generate", *R, "--prompt", "x", "--temperature", "nan"], _run_copy,
     ["--temperature", "nan"]),
    ("generate --top-k 0", ["generate", *R, "--prompt", "x", "--top-k", "0"], _run_copy, ["--top-k", "0"]),
    ("generate --seed 1e20", ["generate", *R, "--prompt", "x", "--seed", str(10**20)], _run_copy,
     ["--seed", "from 0 to 4294967295", str(10**20)]),
    ("generate NaN weights", ["generate", *R, "--prompt", "x", "--checkpoint", "latest"], _nan_weights,
     ["NaN or inf", "step_00000002"]),
    ("generate --prompt not UTF-8", ["generate", *R, "--prompt", b"ab\xff".decode("utf-8", "surrogateescape")],
     _run_copy, ["--prompt", "not UTF-8 text", "byte 0xff at character 2"]),
    ("generate run.json not JSON", ["generate", *R, "--prompt", "x"], _run_json_garbage, ["run.json"]),
    ("generate --verify full, a flipped byte", ["generate", *R, "--prompt", "x", "--verify", "full"],
     _flipped_checkpoint_byte, ["step_00000002", "SHA-256 mismatch in model.safetensors"]),
    ("generate pickle as model.safetensors", ["generate", *R, "--prompt", "x"], _pickle_weights,
     ["not a readable safetensors file"]),
    ("generate int64 weights", ["generate", *R, "--prompt", "x"], _int64_weights, ["is int64"]),
    ("generate run.json eos_id a string", ["generate", *R, "--prompt", "x"], _run_json_eos_id_text, ["eos_id='2'"]),
    ("generate a config of 2000 layers", ["generate", *R, "--prompt", "x"], _config_of_2000_layers,
     ["n_layer=2000", "GiB is available"]),
    # export
    ("export --format bogus", ["export", *R, "--out", "{tmp}/x", "--format", "bogus"], _run_copy,
     ["--format", "bogus"]),
    ("export --run missing", ["export", "--run", "{tmp}/none", "--out", "{tmp}/x", "--format", "hf"], None,
     ["{tmp}/none"]),
    ("export --out a file", ["export", *R, "--out", "{tmp}/file", "--format", "hf"], _file_and_run, ["/file"]),
    ("export --verify full, a flipped byte", ["export", *R, "--out", "{tmp}/x", "--format", "hf", "--verify",
     "full"], _flipped_checkpoint_byte, ["step_00000002", "SHA-256 mismatch in model.safetensors"]),
    ("export pickle as model.safetensors", ["export", *R, "--out", "{tmp}/x", "--format", "hf"], _pickle_weights,
     ["not a readable safetensors file"]),
    ("export int64 weights", ["export", *R, "--out", "{tmp}/x", "--format", "hf"], _int64_weights, ["is int64"]),
    ("export run.json eos_id a string", ["export", *R, "--out", "{tmp}/x", "--format", "hf"], _run_json_eos_id_text,
     ["eos_id='2'"]),
    ("export a config of 2000 layers", ["export", *R, "--out", "{tmp}/x", "--format", "hf"], _config_of_2000_layers,
     ["n_layer=2000", "GiB is available"]),
    ("export --lora lacking fields", ["export", *R, "--out", "{tmp}/x", "--format", "hf", "--lora",
     "{tmp}/lora.safetensors"], _lora_file_lacking_fields,
     ["--lora {tmp}/lora.safetensors: lora_settings metadata lacks alpha, dropout"]),
    # doctor
    ("doctor --hostfile missing", ["doctor", "--hostfile", "{tmp}/none"], None, ["hostfile {tmp}/none", "No such"]),
    ("doctor --hostfile binary", ["doctor", "--hostfile", "{tmp}/hosts"], _hostfile_binary,
     ["hostfile {tmp}/hosts", "binary"]),
    ("doctor --hostfile bad slots", ["doctor", "--hostfile", "{tmp}/hosts"], _hostfile_bad_slots,
     ["slots=four", "line 1"]),
    # demo
    ("demo --time-budget 0", ["demo", "--out", "{tmp}/d", "--time-budget", "0"], None, ["--time-budget", "0"]),
    ("demo --time-budget nan", ["demo", "--out", "{tmp}/d", "--time-budget", "nan"], None, ["--time-budget", "nan"]),
    ("demo --out a file", ["demo", "--out", "{tmp}/file"], _a_file, ["--out", "/file"]),
]  # fmt: skip


# Export to Hugging Face formats looks for transformers (the hf extra, Python 3.11+) before it reads the checkpoint:
# without it, these rows get that one line instead of the one they check.
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="export reads the checkpoint after it finds transformers (the hf extra)",
)
AFTER_TRANSFORMERS = {
    "export --verify full, a flipped byte",
    "export pickle as model.safetensors",
    "export int64 weights",
    "export a config of 2000 layers",
    "export --lora lacking fields",
    "export",  # ACCEPTED's
}


def _cases(rows: list[tuple]) -> list:
    return [pytest.param(*r[1:], id=r[0], marks=NEEDS_TRANSFORMERS if r[0] in AFTER_TRANSFORMERS else ()) for r in rows]


@pytest.mark.parametrize(("argv", "setup", "words"), _cases(ROWS))
def test_bad_input_is_one_line(argv, setup, words, made, tmp_path, monkeypatch, capsys):
    stack: list = []
    try:
        extra = setup(tmp_path, made, monkeypatch, stack) if setup else {}
        values = {"tmp": tmp_path, "corpus": made / "corpus.txt", "data": made / "data", "pid": f"pid {os.getpid()}",
                  "host": socket.gethostname(), **extra}  # fmt: skip
        capsys.readouterr()
        try:
            code = main([a.format(**values) for a in argv])
        except SystemExit as exc:  # argparse's own refusals (a flag's type): the same status and one line
            code = exc.code
        err = capsys.readouterr().err.strip()
    finally:
        for undo in stack:
            undo()
    command = argv[0]
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"lmtrain {command}: error: ")]
    assert code == 2 and len(lines) == 1, err
    for word in words:
        assert word.format(**values) in lines[0], (word.format(**values), lines[0])


ACCEPTED = [
    ("eval", ["eval", *R, "--text", "{corpus}"]),
    ("eval --verify sizes", ["eval", *R, "--text", "{corpus}", "--verify", "sizes"]),
    ("generate --verify sizes", ["generate", *R, "--prompt", "x", "--max-new-tokens", "2", "--verify", "sizes"]),
    ("export", ["export", *R, "--out", "{tmp}/x", "--format", "hf-custom"]),
]  # fmt: skip


@pytest.mark.parametrize("argv", _cases(ACCEPTED))
def test_flipped_checkpoint_byte_passes_a_sizes_check(argv, made, tmp_path, monkeypatch):
    """Sizes only (the default) reads no file's contents: a checkpoint with one bit flipped is used as is (the rows
    above show `--verify full` refusing the same checkpoint)."""
    _flipped_checkpoint_byte(tmp_path, made, monkeypatch, [])
    assert main([a.format(tmp=tmp_path, corpus=made / "corpus.txt") for a in argv]) == 0


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_train_resume_verify(verify, made, tmp_path, monkeypatch, capsys):
    """`train --resume` resumes from a checkpoint with one bit flipped under sizes; under full it names the file and,
    having no other checkpoint, stops in one line with the run directory as it was (starting over would replace a
    checkpoint that may still be recovered)."""
    _flipped_checkpoint_byte(tmp_path, made, monkeypatch, [])
    run = tmp_path / "run"
    before = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = [*T, "--out", "{tmp}/run", "--resume", "--verify", verify]
    code = main([a.format(tmp=tmp_path, data=made / "data") for a in argv])
    captured = capsys.readouterr()
    skipped = "skipping incomplete checkpoint step_00000002: SHA-256 mismatch in model.safetensors"
    resumed = f"resumed from {tmp_path}/run/checkpoints/step_00000002 at step 2"
    if verify == "sizes":
        assert code == 0 and resumed in captured.out and skipped not in captured.out, captured.out
    else:
        assert code == 2 and skipped in captured.out and resumed not in captured.out, captured.out
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and "none usable" in err and "nothing was changed" in err, err
        after = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
        assert {k: v for k, v in after.items() if k != ".lmtrain.lock"} == before  # the lock: the command's own


def test_a_second_ctrl_c_stops_at_once_in_one_line(made, tmp_path, monkeypatch, capsys):
    """A first Ctrl-C asks the loop to save and stop after the step; a second, before the step ends, stops at once:
    one line, status 130, no traceback, and every checkpoint left in the run is complete."""
    import signal

    from lmcore import GPT
    from trainloop.checkpoint import CheckpointStore, verify_checkpoint

    forward, calls = GPT.forward, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # in the middle of step 5 (one forward per step: no accumulation, no evaluation yet)
            signal.raise_signal(signal.SIGINT)  # the handler runs before this returns: stop after this step
            signal.raise_signal(signal.SIGINT)  # and again: at once
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", interrupted)
    argv = [*T, "--out", "{tmp}/r", "--max-steps", "50", "--set", "save_every=2", "--set", "eval_every=100"]
    try:
        code = main([a.format(tmp=tmp_path, data=made / "data") for a in argv])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped lmtrain's main")
    err = capsys.readouterr().err.strip()
    assert code == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == ("lmtrain train: interrupted (Ctrl-C): stopped at once; the newest complete "
                                    "checkpoint is kept (--resume continues from it)"), err  # fmt: skip
    store = CheckpointStore(tmp_path / "r")
    assert store.steps() == [2, 4] and all(verify_checkpoint(store.step_dir(s)) is None for s in store.steps())


def _meta_outside(tmp, made, mp, stack):
    _data_copy(tmp, made, mp, stack)
    _edit_json(tmp / "data" / "meta.json", lambda d: d.update(tokenizer="../../tokenizer.model"))
    return {}


@pytest.mark.parametrize(
    ("setup", "words"),
    [(_meta_garbage, ["meta.json", "unreadable"]), (_meta_wrong_types, ["meta.json", "vocab_size", "many"]),
     (_meta_outside, ["meta.json", "leaves the data directory"])],
    ids=["not JSON", "wrong types", "a path outside"],
)  # fmt: skip
def test_doctor_fails_on_a_bad_meta_json(setup, words, made, tmp_path, monkeypatch, capsys):
    """`doctor --data` reads meta.json as `train` does: what `train` refuses is a FAIL (and a non-zero status)."""
    setup(tmp_path, made, monkeypatch, [])
    code = main(["doctor", "--data", str(tmp_path / "data")])
    out = capsys.readouterr().out
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL data ")]
    assert code == 1 and len(fails) == 1, out
    assert all(w in fails[0] for w in words) and "lmtrain prepare" in fails[0], fails[0]
