"""`lmcore.from_hf` against transformers' own Llama, Qwen2 and Mistral on tiny random checkpoints it wrote."""

import dataclasses
import json
import pickle

import pytest
import torch
from hf_checkpoints import ARCHITECTURES, as_transformers4, random_hf, rewrite_config, write_checkpoint
from safetensors.torch import load_file, save_file

from lmcore import GPT, HFImportError, HFSource, KVCache, estimate_memory, from_hf, generate, n_params

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

SCALINGS = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # The NTK base grows only past max_position_embeddings: inputs of 40 tokens are past 16.
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16),
    # Wavelengths 6.3 (kept), 33 (smoothed) and > 64 (divided) for head_dim 16 at theta 5e5: every band.
    "llama3": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def logits_equal(model: GPT, hf, length: int = 40, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.abs().max() > 0.1  # not a vacuous comparison
    return ours


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_equal_transformers_for_each_architecture(tmp_path, architecture):
    hf = write_checkpoint(tmp_path, architecture)
    model = from_hf(tmp_path)
    assert model.hf_source.architecture == architecture
    assert model.hf_source.config == json.loads((tmp_path / "config.json").read_text())
    assert model.config.position == "rope" and model.config.qkv_bias == (architecture == "Qwen2ForCausalLM")
    assert not model.training and next(model.parameters()).dtype == torch.float32
    # The closed-form count (and the memory estimates built on it) equals both models' count.
    assert n_params(model.config) == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    assert estimate_memory(model.config, 1, 64, "bf16").n_params == n_params(model.config)
    logits_equal(model, hf)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_logits_equal_transformers_for_each_rope_scaling(tmp_path, scaling):
    hf = write_checkpoint(tmp_path, "LlamaForCausalLM", **SCALINGS[scaling])
    model = from_hf(tmp_path)
    assert model.config.rope_scaling == scaling
    ours = logits_equal(model, hf)
    # The scaling shapes the result: the same weights without it give other logits.
    plain = GPT(dataclasses.replace(model.config, rope_scaling="none")).eval()
    plain.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    assert (plain(ids).logits - ours).abs().max() > 1e-3


def test_tied_embeddings_map_and_are_stored_once(tmp_path):
    hf = write_checkpoint(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=True)
    model = from_hf(tmp_path)
    assert model.config.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    logits_equal(model, hf)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_transformers4_and_transformers5_config_layouts_read_alike(tmp_path, architecture):
    hf = write_checkpoint(tmp_path / "v5", architecture, rope_theta=123456.0)
    write_checkpoint(tmp_path / "v4", architecture, rope_theta=123456.0)
    v4 = as_transformers4(tmp_path / "v4")
    assert "rope_parameters" not in v4 and v4["rope_theta"] == 123456.0
    assert "rope_parameters" in json.loads((tmp_path / "v5" / "config.json").read_text())
    new, old = from_hf(tmp_path / "v5"), from_hf(tmp_path / "v4")
    assert old.config == new.config and new.config.rope_theta == 123456.0
    logits_equal(old, hf)
    # transformers itself reads the rewritten file as the same model.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v4").eval()
    logits_equal(old, reloaded)


def test_transformers4_rope_scaling_with_type_key_reads(tmp_path):
    hf = write_checkpoint(tmp_path, "LlamaForCausalLM", **SCALINGS["linear"])
    config = as_transformers4(tmp_path)
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}  # the oldest spelling
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = from_hf(tmp_path)
    assert (model.config.rope_scaling, model.config.rope_factor) == ("linear", 4.0)
    logits_equal(model, hf)


def test_sharded_checkpoint_reads_every_shard(tmp_path):
    hf = random_hf("LlamaForCausalLM")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    logits_equal(from_hf(tmp_path), hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_dtype_converts_each_tensor_and_none_keeps_the_stored_one(tmp_path, dtype):
    hf = write_checkpoint(tmp_path / "fp32", "Qwen2ForCausalLM")
    model = from_hf(tmp_path / "fp32", dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in from_hf(tmp_path / "bf16").parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="expected a floating-point dtype"):
        from_hf(tmp_path / "fp32", dtype=torch.int8)


@pytest.mark.parametrize(
    "architecture, overrides",
    [(a, {}) for a in ARCHITECTURES] + [("LlamaForCausalLM", SCALINGS["dynamic"])],
    ids=ARCHITECTURES + ["llama-dynamic-ntk"],
)
def test_greedy_generation_with_the_cache_equals_transformers(tmp_path, architecture, overrides):
    hf = random_hf(architecture, seed=2, **overrides)
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)  # decisive choices: no near-ties that rounding could break differently
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    prompt = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    ours = generate(model, prompt, 20, temperature=0)  # dynamic NTK: past 16 positions the base grows per step
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True, return_dict_in_generate=True,
                      output_logits=True)  # fmt: skip
    assert out.sequences.tolist() == ours.tolist()
    # The logits of every cached step too: greedy tokens alone forgive small errors (a wrong position included).
    cache, step_input, steps = KVCache(model.config.n_layer), prompt, []
    with torch.no_grad():
        for t in range(20):
            steps.append(model(step_input, kv_cache=cache).logits[:, -1])
            step_input = ours[:, 9 + t : 10 + t]
    torch.testing.assert_close(torch.stack(steps, 1), torch.stack(out.logits, 1), rtol=1e-5, atol=1e-4)


def test_hf_source_round_trips_through_json(tmp_path):
    write_checkpoint(tmp_path, "MistralForCausalLM")
    source = from_hf(tmp_path).hf_source
    assert HFSource.from_dict(json.loads(json.dumps(source.to_dict()))) == source
    assert source.directory == str(tmp_path.resolve())


class Marker:
    """A pickle that would create a file if anything unpickled it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_only(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Marker(d / "UNPICKLED")))


def _drop_tensor(d, name="model.layers.1.mlp.up_proj.weight"):
    state = load_file(d / "model.safetensors")
    del state[name]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def _add_tensor(d):
    state = load_file(d / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def _index_outside(d):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))


BAD = {
    "no config.json": (lambda d: (d / "config.json").unlink(), r"config\.json missing: expected a Hugging Face model"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{oops"), r"config\.json: not JSON"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"no model\.safetensors or model\.safetensors\.index"),
    "pickle only": (
        _pickle_only,
        r"pytorch_model\.bin but no model\.safetensors: expected safetensors.*never "
        r"unpickles.*fix: convert it once",
    ),
    "not safetensors": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x80\x04junk"),
        r"model\.safetensors: not a readable safetensors file",
    ),
    "unknown architecture": (
        lambda d: rewrite_config(d, architectures=["GPT2LMHeadModel"]),
        r"config\.json: architectures=\['GPT2LMHeadModel'\]: expected one of LlamaForCausalLM",
    ),
    "no architecture": (
        lambda d: rewrite_config(d, architectures=None, model_type="gpt2"),
        r"architectures is missing and model_type='gpt2'.*fix: add \"architectures\"",
    ),
    "missing field": (lambda d: rewrite_config(d, hidden_size=None), r"config\.json: hidden_size missing"),
    "yarn (transformers 5)": (
        lambda d: rewrite_config(d, rope_parameters={"rope_type": "yarn", "factor": 2.0}),
        r"rope_parameters\.rope_type='yarn': expected one of default, linear, dynamic, llama3",
    ),
    "longrope (transformers 4)": (
        lambda d: as_transformers4(d) and rewrite_config(d, rope_scaling={"type": "longrope"}),
        r"rope_scaling\.rope_type='longrope': expected one of",
    ),
    "shape disagrees": (
        lambda d: rewrite_config(d, intermediate_size=96),
        r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \(64, 128\): "
        r"expected \(64, 96\) from .*config\.json",
    ),
    "missing tensor": (_drop_tensor, r"tensor model\.layers\.1\.mlp\.up_proj\.weight missing: expected every tensor"),
    "unexpected tensor": (_add_tensor, r"model\.safetensors: unexpected tensor model\.layers\.0\.self_attn\.q_norm"),
    "shard outside the directory": (
        _index_outside,
        r"weight_map names shard '\.\./model\.safetensors': expected a "
        r"file name inside",
    ),
    "head_dim decoupled": (lambda d: rewrite_config(d, head_dim=32), r"head_dim=32: expected hidden_size / "),
    "biases on attention only": (
        lambda d: rewrite_config(d, attention_bias=True),
        r"attention_bias=True, mlp_bias=False: expected both true or both false",
    ),
    "quantized": (
        lambda d: rewrite_config(d, quantization_config={"quant_method": "gptq"}),
        r"quantization_config \(quant_method='gptq'\): expected unquantized weights",
    ),
    "activation": (lambda d: rewrite_config(d, hidden_act="gelu"), r"hidden_act='gelu': expected 'silu'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_naming_file_field_expectation(tmp_path, case):
    write_checkpoint(tmp_path, "LlamaForCausalLM")
    damage, pattern = BAD[case]
    damage(tmp_path)
    with pytest.raises(HFImportError, match=pattern) as err:
        from_hf(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    assert isinstance(err.value, ValueError)
    assert not (tmp_path / "UNPICKLED").exists()


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("MistralForCausalLM", dict(sliding_window=16)),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ],  # fmt: skip
)
def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path, architecture, overrides):
    write_checkpoint(tmp_path, architecture, **overrides)
    with pytest.raises(HFImportError, match=r"sliding_window=16 < max_position_embeddings=\d+: expected full causal"):
        from_hf(tmp_path)


def test_a_sliding_window_that_never_applies_is_accepted(tmp_path):
    hf = write_checkpoint(tmp_path, "Qwen2ForCausalLM", use_sliding_window=False, sliding_window=16)
    logits_equal(from_hf(tmp_path), hf)
    hf = write_checkpoint(tmp_path / "m", "MistralForCausalLM", sliding_window=64, max_position_embeddings=64)
    logits_equal(from_hf(tmp_path / "m"), hf)


def test_a_given_config_may_change_only_what_changes_no_tensor(tmp_path):
    pytest.importorskip("transformers")
    import dataclasses

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lmcore import from_hf
    from lmcore.hf_llama import HFImportError, config_from_hf

    Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128)).save_pretrained(tmp_path)  # fmt: skip
    mapped = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    model = from_hf(tmp_path, config=dataclasses.replace(mapped, dropout=0.1, checkpointing="block"))
    assert (model.config.dropout, model.config.checkpointing) == (0.1, "block")
    with pytest.raises(HFImportError, match=r"config.json: the config given for rope_theta is 500.0"):
        from_hf(tmp_path, config=dataclasses.replace(mapped, rope_theta=500.0))
