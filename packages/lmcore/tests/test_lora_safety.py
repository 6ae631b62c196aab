"""Adapters that cannot be right are refused in one line: a non-finite alpha, NaN or inf adapter weights (at merge
and at load), adapters trained on another base (the base's weights hash is recorded at save); files written follow
the umask and never go through a link; generation refuses a non-finite temperature; a GGUF write cut short names
its cause."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmcore import GPT, ModelConfig, apply_lora, generate, load_lora, merge_lora, save_lora


def tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig.from_preset("tiny", **overrides))


def trained(seed: int = 0) -> GPT:
    model = apply_lora(tiny(seed), r=4)
    for adapter in (model.layers[0].self_attn.q_proj, model.layers[1].self_attn.v_proj):
        torch.nn.init.normal_(adapter.lora_B)  # as if trained
    return model


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -16.0, 0.0, True])
def test_apply_refuses_an_alpha_that_is_not_a_finite_positive_number(alpha):
    with pytest.raises(ValueError, match="LoRA alpha must be a finite number > 0"):
        apply_lora(tiny(), r=4, alpha=alpha)


POISON = [("nan in B", "lora_B", float("nan")), ("inf in A", "lora_A", float("inf")), ("-inf in B", "lora_B",
                                                                                         float("-inf"))]  # fmt: skip


@pytest.mark.parametrize(("part", "value"), [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_non_finite_adapters_are_refused_at_merge_and_at_load(tmp_path, part, value):
    model = trained()
    getattr(model.layers[1].self_attn.v_proj, part).data[0, 0] = value
    before = model.layers[1].self_attn.v_proj.base.weight.clone()
    with pytest.raises(ValueError, match=rf"layers.1.self_attn.v_proj.{part} holds NaN or inf"):
        merge_lora(model)
    assert torch.equal(model.layers[1].self_attn.v_proj.base.weight, before)  # nothing was merged
    path = save_lora(model, tmp_path / "adapters.safetensors")
    with pytest.raises(ValueError, match="holds NaN or inf values"):
        load_lora(tiny(), path)


def test_adapters_record_their_base_and_refuse_another(tmp_path):
    path = save_lora(trained(seed=0), tmp_path / "adapters.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert len(f.metadata()["lora_base_sha256"]) == 64
    ids = torch.randint(0, 97, (1, 8))
    load_lora(tiny(seed=0), path)  # the base they were trained on
    load_lora(tiny(seed=0).to(torch.bfloat16), path)  # the same base, in bf16
    with pytest.raises(ValueError, match="these adapters were trained on another base"):
        load_lora(tiny(seed=1), path)  # same shapes, other weights
    merged = merge_lora(load_lora(tiny(seed=0), path)).eval()
    assert torch.isfinite(merged(ids).logits).all()


def test_adapters_without_a_base_record_load_with_a_warning(tmp_path):
    path = save_lora(trained(seed=0), tmp_path / "adapters.safetensors")
    with safe_open(str(path), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "lora_base_sha256"}
    save_file(load_file(str(path)), str(path), metadata=metadata)  # as an earlier version wrote them
    with pytest.warns(UserWarning, match="record no base model"):
        load_lora(tiny(seed=1), path)


def test_merge_refuses_a_base_changed_under_the_adapters():
    model = trained(seed=0)
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.add_(1.0)  # another base now, the adapters unchanged
    with pytest.raises(ValueError, match="the base weights changed since the adapters were put on them"):
        merge_lora(model)


def test_a_saved_lora_model_reloads_and_merges(tmp_path):
    model = trained(seed=0)
    model.save_pretrained(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = merge_lora(GPT.from_pretrained(tmp_path / "ckpt"))
    assert not hasattr(merged, "lora_base_sha256")


def _save_lora(model, path):
    save_lora(model, path)


def _save_pretrained(model, path):
    merge_lora(model).save_pretrained(path.parent / "pretrained")


def _save_custom(model, path):
    from lmcore.hf_custom import save_custom

    save_custom(merge_lora(model), path.parent / "custom")


WRITERS = [("save_lora", _save_lora), ("save_pretrained", _save_pretrained), ("save_custom", _save_custom)]


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask 022", "umask 027"])
@pytest.mark.parametrize("write", [w[1] for w in WRITERS], ids=[w[0] for w in WRITERS])
def test_written_files_follow_the_umask(tmp_path, write, mask):
    old = os.umask(mask)
    try:
        write(trained(), tmp_path / "adapters.safetensors")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    wrong = {
        p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o666 & ~mask
    }
    assert not wrong, f"expected {oct(0o666 & ~mask)} under umask {oct(mask)}"


LINKS = [("symbolic link", lambda t, v: t.symlink_to(v)), ("hard link", lambda t, v: os.link(v, t))]


@pytest.mark.parametrize("link", [k[1] for k in LINKS], ids=[k[0] for k in LINKS])
def test_adapters_are_never_written_through_a_link(tmp_path, link):
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    link(tmp_path / "adapters.safetensors", victim)
    with pytest.raises(ValueError, match="remove it"):
        save_lora(trained(), tmp_path / "adapters.safetensors")
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_generate_refuses_a_temperature_that_is_not_a_finite_number_at_least_zero(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        generate(tiny().eval(), torch.tensor([[1, 2, 3]]), 4, temperature=temperature)


def test_a_gguf_write_cut_short_says_why():
    from pathlib import Path

    from lmcore.gguf_mpt import short_write_error

    cut = OSError("25600 requested and 15488 written")
    assert short_write_error(cut, Path("/nonexistent/m.gguf")).errno == errno.ENOSPC
    assert short_write_error(cut, Path("/nonexistent/m.gguf")).filename == "/nonexistent/m.gguf"
    eio = OSError(errno.EIO, "I/O error")
    assert short_write_error(eio, Path("m.gguf")) is eio


LIMITED_GGUF = """
import resource, torch
from lmcore import GPT, ModelConfig
from lmcore.gguf_mpt import GGUFVocab, write_gguf
model = GPT(ModelConfig.from_preset("tiny", bias=False))
vocab = GGUFVocab([f"t{{i}}" for i in range(97)], [0.0] * 97, [1] * 97, eos_id=2, bos_id=2)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
try:
    write_gguf(model, {path!r}, vocab, context_length=64)
except OSError as exc:
    print("ERRNO", exc.errno, exc.filename)
"""


def test_a_gguf_write_past_the_file_size_limit_is_efbig_naming_the_file(tmp_path):
    pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LIMITED_GGUF.format(path=path))], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERRNO ")]
    assert said == [f"ERRNO {errno.EFBIG} {path}"], proc.stdout + proc.stderr[-3000:]
