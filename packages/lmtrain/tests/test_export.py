"""`lmtrain export` against the real transformers and peft: every tensor it writes is the model's (names, shapes,
values: exported_tensors.py), and what it writes loads and computes what we compute."""

import json
import os
from pathlib import Path

import pytest
import torch
from exported_tensors import (
    assert_same_tensors,
    custom_base_tensors,
    custom_peft_tensors,
    custom_tensors,
    mpt_tensors,
    peft_tensors,
)
from trained_runs import tiny_run, variant_run

from lmtrain.cli import main

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

# Newlines (blank lines too), leading and doubled spaces, tabs, CRLF, non-ASCII text and characters the 400-piece
# tokenizer has never seen (byte fallback), and the special pieces' spellings as plain text.
TEXT = (
    "def main():\n    return 0\n\n\n  leading spaces,  doubled  spaces\tand a tab\r\n"
    "Ünïcödé — 日本語 🎉 ﬁ\n</s> is text here\n"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def ours(run_dir, checkpoint="best"):
    from lmtrain.run_files import load_trained_model

    return load_trained_model(run_dir, checkpoint=checkpoint)[0]


def export(*args: str) -> int:
    return main(["export", *[str(a) for a in args]])


def written(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def no_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-export" in p.name or ".old-export" in p.name]


def test_hf_export_loads_without_custom_code_and_matches_the_checkpoint(run, tmp_path):
    out = tmp_path / "hf"
    assert export("--run", run, "--out", out, "--format", "hf") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mpt" and "auto_map" not in config
    assert not list(out.glob("*.py"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MptForCausalLM"
    model = ours(run)
    assert_same_tensors(written(out / "model.safetensors"), mpt_tensors(model))
    torch.manual_seed(0)
    for length in (20, 3 * model.config.context_length):  # the second runs past the training context (ALiBi)
        ids = torch.randint(0, model.config.vocab_size, (2, length))
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    from lmcore import generate

    prompt = torch.randint(0, model.config.vocab_size, (1, 5))
    expected = generate(model, prompt, 40, temperature=0, eos_id=hf.generation_config.eos_token_id)
    assert hf.generate(prompt, max_new_tokens=40, do_sample=False).tolist() == expected.tolist()
    mask = os.umask(0)
    os.umask(mask)
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~mask for p in out.iterdir())
    assert no_leftovers(tmp_path) == []


def test_hf_tokenizer_gives_our_ids(run, tmp_path):
    from lmtrain.run_files import load_tokenizer
    from lmtrain.text_codec import encode

    out = tmp_path / "hf"
    assert export("--run", run, "--out", out, "--format", "hf") == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = load_tokenizer(run)
    ids = encode(sp, TEXT)
    assert any(sp.is_byte(i) for i in ids)  # the text does reach the byte fallback
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.decode(ids) == TEXT
    assert hf_tok.eos_token_id == json.loads((run / "run.json").read_text())["eos_id"]


def test_custom_export_takes_a_model_mpt_cannot_express(run, tmp_path):
    from lmcore import GPT, ModelConfig

    torch.manual_seed(0)
    config = ModelConfig.from_dict({**ours(run).config.to_dict(), "bias": True, "activation": "swiglu", "d_ff": None})
    model = GPT(config).eval()
    other = variant_run(run, tmp_path / "run", {3: model})
    out = tmp_path / "custom"
    assert export("--run", other, "--out", out, "--format", "hf-custom") == 0
    assert_same_tensors(written(out / "model.safetensors"), custom_tensors(model))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, config.vocab_size, (2, 70))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out)("a\n b", add_special_tokens=False)["input_ids"]


def test_default_format_writes_mpt_where_the_model_maps_and_custom_code_otherwise(run, tmp_path, capsys):
    from lmcore import GPT, ModelConfig

    capsys.readouterr()
    assert export("--run", run, "--out", tmp_path / "mpt") == 0  # no --format: hf
    said = capsys.readouterr()
    assert "wrote transformers' MPT" in said.err and "transformers' MPT; no custom code" in said.out
    assert json.loads((tmp_path / "mpt" / "config.json").read_text())["model_type"] == "mpt"
    torch.manual_seed(0)
    biased = GPT(ModelConfig.from_dict({**ours(run).config.to_dict(), "bias": True})).eval()
    other = variant_run(run, tmp_path / "run", {1: biased}, best=1)
    assert export("--run", other, "--out", tmp_path / "custom", "--format", "hf") == 0
    said = capsys.readouterr()
    assert "wrote custom code" in said.err and "bias=True" in said.err, said.err
    assert "trust_remote_code=True" in said.out
    assert_same_tensors(written(tmp_path / "custom" / "model.safetensors"), custom_tensors(biased))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "custom", trust_remote_code=True).eval()
    ids = torch.randint(0, biased.config.vocab_size, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, biased(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_biased_run_exports_its_adapters_for_peft_and_runs_in_a_pipeline(run, tmp_path):
    # Biases (the default presets') keep a model off MPT: the custom-code base, and the adapters in PEFT's layout.
    peft = pytest.importorskip("peft")
    from lmcore import GPT, ModelConfig, apply_lora, save_lora

    torch.manual_seed(0)
    biased = GPT(ModelConfig.from_dict({**ours(run).config.to_dict(), "bias": True})).eval()
    other = variant_run(run, tmp_path / "run", {1: biased}, best=1)
    model = apply_lora(ours(other), targets=("q", "k", "v", "o", "down"), r=4, alpha=8)
    with torch.no_grad():  # adapters that change the output (B = 0 would pass with no adapter at all)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    out = tmp_path / "hf"
    adapters = save_lora(model, tmp_path / "adapters.safetensors")
    assert export("--run", other, "--out", out, "--lora", adapters) == 0
    assert_same_tensors(written(out / "model.safetensors"), custom_base_tensors(model))
    assert_same_tensors(written(out / "adapter" / "adapter_model.safetensors"), custom_peft_tensors(model))
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out.resolve()) and config["r"] == 4 and config["lora_alpha"] == 8
    base = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    wrapped = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = model.eval()(ids).logits
        torch.testing.assert_close(wrapped(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert (expected - ours(other)(ids).logits).abs().max() > 1e-3
    generator = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True)
    [answer] = generator("def main():", max_new_tokens=6, do_sample=False)
    assert answer["generated_text"].startswith("def main():")


@pytest.mark.parametrize("case", ["no checkpoint", "unknown format", "not empty", "does not map", "unigram"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(run, tmp_path, capsys, case):
    from lmcore import GPT, ModelConfig

    out, fmt, source = tmp_path / "out", "hf", run
    if case == "no checkpoint":
        source = variant_run(run, tmp_path / "run", {})
        named = "no complete checkpoint"
    elif case == "unknown format":
        fmt, named = "onnx", "--format 'onnx': expected one of hf, hf-mpt, hf-custom"
    elif case == "not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        named = "not empty; pass --force"
    elif case == "does not map":
        plain = GPT(ModelConfig.from_dict({**ours(run).config.to_dict(), "bias": True}))
        source = variant_run(run, tmp_path / "run", {1: plain}, best=1)
        fmt, named = "hf-mpt", "bias=True (MPT: no biases)"
    else:  # a SentencePiece unigram model: transformers' Unigram matches control pieces inside text, SentencePiece not
        import tokbin
        from lmtrain.text_codec import LOSSLESS_SPM_OPTIONS

        source = variant_run(run, tmp_path / "run", {4: ours(run)}, best=4)
        options = {**LOSSLESS_SPM_OPTIONS, "num_threads": 1}
        model = tokbin.train_tokenizer(
            [run.parent / "input.txt"], tmp_path / "uni", 400, model_type="unigram", **options
        )
        os.replace(model, source / "tokenizer.model")
        record = json.loads((source / "run.json").read_text())  # a run trained with this tokenizer records it
        (source / "run.json").write_text(
            json.dumps({**record, "tokenizer_sha256": tokbin.file_sha256(source / "tokenizer.model")})
        )
        named = "disagrees with SentencePiece"
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert export("--run", source, "--out", out, "--format", fmt) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[lmtrain ")]
    assert len(err) == 1 and err[0].startswith("lmtrain export: error: ") and named in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing new beside DIR
    assert not out.exists() or [p.name for p in out.iterdir()] == ["keep.txt"]
    if case == "unigram":
        assert export("--run", source, "--out", out, "--format", fmt, "--no-tokenizer") == 0
        assert not (out / "tokenizer.json").exists()


def test_force_replaces_a_non_empty_directory(run, tmp_path):
    out = tmp_path / "nested" / "out"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("old export")
    assert export("--run", run, "--out", out, "--format", "hf", "--force", "--checkpoint", "2") == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert no_leftovers(out.parent) == []


def test_lora_adapters_export_in_peft_layout(run, tmp_path):
    peft = pytest.importorskip("peft")
    from lmcore import apply_lora, save_lora

    model = apply_lora(ours(run), targets=("q", "v", "o", "up"), r=4, alpha=8)
    with torch.no_grad():  # adapters that change the output (B = 0 would pass with no adapter at all)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapters = save_lora(model, tmp_path / "adapters.safetensors")
    out = tmp_path / "hf"
    assert export("--run", run, "--out", out, "--format", "hf", "--lora", adapters) == 0
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        out.resolve()
    )
    assert_same_tensors(written(out / "model.safetensors"), mpt_tensors(model))  # the base weights
    assert_same_tensors(written(out / "adapter" / "adapter_model.safetensors"), peft_tensors(model))
    base = transformers.AutoModelForCausalLM.from_pretrained(out)
    wrapped = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = model.eval()(ids).logits
        torch.testing.assert_close(wrapped(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert (expected - ours(run)(ids).logits).abs().max() > 1e-3
    merged = tmp_path / "merged"
    assert export("--run", run, "--out", merged, "--format", "hf", "--lora", adapters, "--merge-lora") == 0
    assert not (merged / "adapter").exists()
    from lmcore import merge_lora

    assert_same_tensors(written(merged / "model.safetensors"), mpt_tensors(merge_lora(model)))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_missing_hf_extra_is_one_line_naming_it(run, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: import raises ModuleNotFoundError
    capsys.readouterr()
    assert export("--run", run, "--out", tmp_path / "out", "--format", "hf") == 2
    err = capsys.readouterr().err.strip().splitlines()
    from lmcore.extras import install_hint

    hint = install_hint("hf", "lmtrain")
    assert hint.startswith('pip install -e "') or hint.startswith('pip install "')  # the checkout, not the index
    assert err == [f"lmtrain export: error: lmtrain export needs transformers, which is not installed: {hint}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["google.protobuf", "google"])
def test_hf_extra_without_protobuf_is_one_line_naming_it(run, tmp_path, capsys, monkeypatch, missing):
    # transformers installed, protobuf (the extra's other half, which reads the SentencePiece model) not.
    import sys

    monkeypatch.delitem(sys.modules, "google.protobuf", raising=False)
    monkeypatch.delitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: import raises ModuleNotFoundError
    capsys.readouterr()
    assert export("--run", run, "--out", tmp_path / "out", "--format", "hf") == 2
    err = capsys.readouterr().err.strip().splitlines()
    from lmcore.extras import install_hint

    hint = install_hint("hf", "lmtrain")
    assert err == ["lmtrain export: error: lmtrain export needs protobuf (to convert the tokenizer), which is not "
                   f"installed: {hint} (or --no-tokenizer to export the model alone)"]  # fmt: skip
    assert not (tmp_path / "out").exists()
    assert export("--run", run, "--out", tmp_path / "model", "--format", "hf", "--no-tokenizer") == 0
