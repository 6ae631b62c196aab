"""A Llama-family model back out as the same architecture (transformers loads it) and as a PEFT adapter directory
that peft loads onto the original base."""

import copy
import json

import pytest
import torch
from hf_checkpoints import ARCHITECTURES, as_transformers4, write_checkpoint
from safetensors.torch import load_file

from lmcore import GPT, ModelConfig, apply_lora, from_hf, merge_lora
from lmcore.hf_export import save_hf, save_peft_adapter

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

LLAMA_LIKE = dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=2, d_ff=96, bias=False)


def load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def ids(vocab: int = 100, length: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(5))


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_round_trip_keeps_the_architecture_every_tensor_and_the_config(tmp_path, architecture):
    hf = write_checkpoint(tmp_path / "base", architecture)
    model = from_hf(tmp_path / "base")
    out = save_hf(model, tmp_path / "out")
    exported = load(out)
    assert type(exported).__name__ == architecture
    original, written = load_file(tmp_path / "base" / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in written.items()} == {k: tuple(v.shape) for k, v in original.items()}
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "base" / "config.json").read_text())
    torch.testing.assert_close(logits(exported, ids()), logits(hf, ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16),
        dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ],
    ids=["linear", "dynamic", "llama3"],
)  # fmt: skip
def test_rope_scaling_survives_the_round_trip(tmp_path, rope):
    hf = write_checkpoint(tmp_path / "base", "LlamaForCausalLM", **rope)
    exported = load(save_hf(from_hf(tmp_path / "base"), tmp_path / "out"))
    assert exported.config.rope_parameters["rope_type"] == rope["rope_scaling"]["rope_type"]
    torch.testing.assert_close(logits(exported, ids()), logits(hf, ids()), rtol=1e-5, atol=1e-5)


def test_a_transformers4_config_is_written_back_in_its_own_layout(tmp_path):
    hf = write_checkpoint(tmp_path / "base", "Qwen2ForCausalLM", rope_theta=1e6)
    as_transformers4(tmp_path / "base")
    out = save_hf(from_hf(tmp_path / "base"), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert "rope_parameters" not in config and config["rope_theta"] == 1e6 and config["rope_scaling"] is None
    torch.testing.assert_close(logits(load(out), ids()), logits(hf, ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, architecture",
    [
        (dict(qkv_bias=True), "Qwen2ForCausalLM"),
        (dict(), "LlamaForCausalLM"),
        (dict(bias=True, tie_embeddings=False), "LlamaForCausalLM"),  # attention_bias and mlp_bias
        (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_context=16, rope_theta=5e5), "LlamaForCausalLM"),
    ],
)
def test_a_model_trained_here_with_rope_exports_as_llama_or_qwen2(tmp_path, overrides, architecture):
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny", **{**LLAMA_LIKE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    exported = load(save_hf(model, tmp_path))
    assert type(exported).__name__ == architecture
    x = ids(97)
    torch.testing.assert_close(logits(exported, x), logits(model, x), rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in model.parameters())


def test_models_that_do_not_map_are_refused_naming_the_fields(tmp_path):
    with pytest.raises(ValueError, match=r"position='alibi' \(LlamaForCausalLM: rope\)"):
        save_hf(GPT(ModelConfig.from_preset("tiny")), tmp_path)
    rope = GPT(ModelConfig.from_preset("tiny", **LLAMA_LIKE))
    with pytest.raises(ValueError, match=r"qkv_bias=False \(Qwen2ForCausalLM: biases on q, k, v\)"):
        save_hf(rope, tmp_path, architecture="Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="merge_lora"):
        save_hf(apply_lora(rope, r=2), tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_peft_adapter_on_the_original_base_equals_the_merged_export(tmp_path, architecture):
    write_checkpoint(tmp_path / "base", architecture)
    tuned = apply_lora(from_hf(tmp_path / "base"), targets=["q", "k", "v", "o", "mlp"], r=4, alpha=8)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # as if trained
    adapter = save_peft_adapter(tuned, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    x = ids()
    ours = logits(tuned.eval(), x)
    peft = pytest.importorskip("peft")
    with_adapter = peft.PeftModel.from_pretrained(load(tmp_path / "base"), adapter).eval()
    assert len(with_adapter.base_model.model.model.layers[0].self_attn.q_proj.lora_A) == 1  # the adapter is in
    merged_dir = save_hf(merge_lora(copy.deepcopy(tuned)), tmp_path / "merged")
    merged = logits(load(merged_dir), x)
    torch.testing.assert_close(logits(with_adapter, x), merged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, ours, rtol=1e-5, atol=1e-5)
    assert (merged - logits(load(tmp_path / "base"), x)).abs().max() > 1e-3  # the adapters change the model


def test_exporting_into_the_directory_it_came_from_replaces_the_files(tmp_path):
    """The imported parameters share the old file's pages: the export must leave that file's inode alone (safetensors
    itself writes a new file; save_hf renames its own temporary files too)."""
    hf = write_checkpoint(tmp_path, "LlamaForCausalLM")
    model = from_hf(tmp_path)
    inode = (tmp_path / "model.safetensors").stat().st_ino
    other = from_hf(tmp_path)
    with torch.no_grad():
        other.layers[0].mlp.up_proj.weight.mul_(3)  # a different model written over the same directory
    save_hf(other, tmp_path)
    assert (tmp_path / "model.safetensors").stat().st_ino != inode
    torch.testing.assert_close(logits(model, ids()), logits(hf, ids()), rtol=1e-5, atol=1e-5)  # still the original
    assert (logits(from_hf(tmp_path), ids()) - logits(hf, ids())).abs().max() > 1e-3  # the new file is the other one
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left
