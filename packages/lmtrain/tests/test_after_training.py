"""After training: the Hugging Face export reproduces `lmtrain generate` through a plain pipeline, carries what
llama.cpp's converter reads, and `export --format gguf` writes a file gguf's reader checks."""

import json
import sys

import pytest
import torch
from exported_tensors import assert_gguf_holds
from trained_runs import tiny_run, variant_run

from lmtrain.cli import main

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

PROMPTS = ["def main(", "import os\n", "class Parser:\n    ", "    return ", "# a comment", "x = [1, 2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def random_run(run, tmp_path_factory):
    """The tiny run's tokenizer with a random model whose greedy text is not one token repeated (which four training
    steps and a plain random init give): its weight matrices scaled up 10x, so the document-start token changes what
    follows a prompt and logits are far from ties. Byte pieces get zero embeddings, so that no greedy choice is a
    lone byte (invalid UTF-8 that the two libraries' decoders spell differently)."""
    from lmcore import GPT, ModelConfig
    from lmtrain.run_files import load_tokenizer, load_trained_model

    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict(load_trained_model(run)[0].config.to_dict())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(10)
        sp = load_tokenizer(run)
        model.embed_tokens.weight[[i for i in range(sp.get_piece_size()) if sp.is_byte(i)]] = 0
    return variant_run(run, tmp_path_factory.mktemp("random") / "run", {4: model}, best=4)


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmtrain {command}: error: "), err
    return err[0]


@pytest.mark.parametrize("fmt", ["hf", "hf-custom"])
def test_pipeline_reproduces_lmtrain_generate(random_run, tmp_path, fmt):
    from lmtrain.sample import generate_text

    out = tmp_path / "hf"
    assert main(["export", "--run", str(random_run), "--out", str(out), "--format", fmt]) == 0
    pipe = transformers.pipeline("text-generation", model=str(out), trust_remote_code=fmt == "hf-custom")
    without_prefix = 0
    for prompt in PROMPTS:
        ours = generate_text(str(random_run), prompt, max_new_tokens=24, temperature=0)
        assert len(ours) > len(prompt)
        theirs = pipe(prompt, max_new_tokens=24, do_sample=False)[0]["generated_text"]
        assert theirs == ours, prompt
        plain = pipe(prompt, max_new_tokens=24, do_sample=False, add_special_tokens=False)[0]["generated_text"]
        without_prefix += plain != ours
    assert without_prefix > 0  # the document-start token is what makes them agree


def test_hf_export_carries_what_llama_cpp_reads(run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out), "--format", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MPTForCausalLM"]  # llama.cpp's converter registers this spelling
    assert (out / "tokenizer.model").read_bytes() == (run / "tokenizer.model").read_bytes()
    run_json = json.loads((run / "run.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eos = run_json["eos_id"]
    assert tok.bos_token_id == tok.eos_token_id == eos == config["bos_token_id"] == config["eos_token_id"]
    assert tok("a\nb")["input_ids"] == [eos] + tok("a\nb", add_special_tokens=False)["input_ids"]
    assert tok.model_max_length == run_json["data_config"]["seq_len"]  # what the model was trained at
    assert config["max_seq_len"] == 4 * run_json["data_config"]["seq_len"]  # how far the MPT export runs
    assert transformers.AutoModelForCausalLM.from_pretrained(out).__class__.__name__ == "MptForCausalLM"


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gguf_export_reads_back_with_gguf(run, tmp_path, outtype):
    gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from lmtrain.run_files import load_tokenizer, load_trained_model

    path = tmp_path / "model.gguf"
    assert main(["export", "--run", str(run), "--out", str(path), "--format", "gguf", "--outtype", outtype]) == 0
    reader = gguf.GGUFReader(path)
    model = load_trained_model(run)[0]
    c, sp = model.config, load_tokenizer(run)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 6 * c.n_layer  # bias-free, tied head: no output.weight
    assert [int(x) for x in tensors["token_embd.weight"].shape] == [c.d_model, c.vocab_size]  # GGUF: fastest first
    assert [int(x) for x in tensors["blk.0.attn_qkv.weight"].shape] == [c.d_model, 3 * c.d_model]
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == outtype.upper()
    assert_gguf_holds(reader, model, outtype)  # every tensor: names, shapes, values

    def get(key):
        return reader.get_field(key).contents()

    assert get("general.architecture") == "mpt"
    assert get("mpt.attention.max_alibi_bias") == 8.0
    assert get("mpt.context_length") == 4 * c.context_length  # as the MPT export's max_seq_len
    assert get("mpt.block_count") == c.n_layer and get("mpt.attention.head_count") == c.n_head
    assert get("tokenizer.ggml.model") == "llama"
    assert get("tokenizer.ggml.tokens") == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = get("tokenizer.ggml.token_type")
    assert types[sp.piece_to_id("\n")] == 4 and types[sp.eos_id()] == 3 and types[sp.piece_to_id("<0x41>")] == 6
    eos = json.loads((run / "run.json").read_text())["eos_id"]
    assert get("tokenizer.ggml.eos_token_id") == get("tokenizer.ggml.bos_token_id") == eos
    assert get("tokenizer.ggml.add_bos_token") is True and get("tokenizer.ggml.add_space_prefix") is False
    assert get("general.file_type") == {"f32": 0, "f16": 1}[outtype]


@pytest.mark.parametrize("case", ["cannot hold", "exists", "not .gguf", "gguf missing", "adapters unmerged"])
def test_gguf_bad_input_is_one_line_and_writes_nothing(run, tmp_path, capsys, monkeypatch, case):
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from lmcore import GPT, ModelConfig
    from lmtrain.run_files import load_trained_model

    source, out, extra = run, tmp_path / "model.gguf", []
    if case == "cannot hold":
        config = {**load_trained_model(run)[0].config.to_dict(), "activation": "swiglu", "d_ff": None}
        source = variant_run(run, tmp_path / "run", {4: GPT(ModelConfig.from_dict(config))}, best=4)
        named = "activation='swiglu' (GGUF MPT: gelu)"
    elif case == "exists":
        out.write_text("mine")
        named = "exists; pass --force"
    elif case == "not .gguf":
        out, named = tmp_path / "model.bin", "name it NAME.gguf"
    elif case == "adapters unmerged":
        from lmcore import apply_lora, save_lora

        extra = ["--lora", str(save_lora(apply_lora(load_trained_model(run)[0], r=2), tmp_path / "lora.safetensors"))]
        named = "--format gguf takes no separate adapters: add --merge-lora"
    else:
        monkeypatch.setitem(sys.modules, "gguf", None)
        named = "needs gguf, which is not installed: pip install"
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert main(["export", "--run", str(source), "--out", str(out), "--format", "gguf", *extra]) == 2
    assert named in one_line_error(capsys, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "exists":
        assert out.read_text() == "mine"


def test_llama_cpp_runs_the_gguf_export_where_installed(run, tmp_path):
    """Optional (llama-cpp-python is not in CI): llama.cpp's tokens and logits on the f32 file against ours.
    Tolerance: llama.cpp computes MPT's GELU with the tanh approximation (from an fp16 table), ours is exact; the
    benchmark measured 0.0074 on logits up to 11.4 for a trained cpu-small (docs/benchmarks.md)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import numpy as np

    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.text_codec import encode

    path = tmp_path / "model.gguf"
    assert main(["export", "--run", str(run), "--out", str(path), "--format", "gguf", "--outtype", "f32"]) == 0
    model, run_json, _ = load_trained_model(run)
    text = (run.parent / "input.txt").read_text(encoding="utf-8")[:3000]
    ours = [run_json.eos_id] + encode(load_tokenizer(run), text)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, n_ubatch=128, logits_all=True,
                          n_threads=1, verbose=False)  # fmt: skip
    assert llm.tokenize(text.encode("utf-8"), add_bos=True, special=False) == ours
    window = ours[:96]  # three training contexts
    llm.eval(window)
    theirs = torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32))
    with torch.no_grad():
        expected = model(torch.tensor([window])).logits[0]
    torch.testing.assert_close(theirs, expected, rtol=0, atol=0.02)
