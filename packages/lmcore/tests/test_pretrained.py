import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmcore import GPT, ModelConfig, apply_lora, merge_lora


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False, n_kv_head=2, activation="swiglu")])
def test_round_trip_gives_the_same_model(tmp_path, overrides):
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny", **overrides)).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == model.config.to_dict()
    loaded = GPT.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == model.config.tie_embeddings
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_weights_that_do_not_match_the_config_name_the_key(tmp_path):
    GPT(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["d_ff"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.(up|down)_proj\.weight has shape"):
        GPT.from_pretrained(tmp_path)


def test_missing_key_and_bad_config_are_clear_errors(tmp_path):
    GPT(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing keys \\['norm.weight'\\]"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_layers": 2}))
    with pytest.raises(ValueError, match="n_layers"):
        GPT.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT.from_pretrained(tmp_path / "nowhere")


def test_saved_precision_is_kept(tmp_path):
    GPT(ModelConfig.from_preset("tiny")).to(torch.bfloat16).save_pretrained(tmp_path)
    assert GPT.from_pretrained(tmp_path).embed_tokens.weight.dtype == torch.bfloat16


def test_consolidated_state_dict_is_written_in_the_one_layout(tmp_path):
    """trainloop's checkpoints: save_pretrained(dir, state_dict=...) with both names of the tied head, on any device."""
    model = GPT(ModelConfig.from_preset("tiny")).eval()
    state = {k: v.clone() * 2 for k, v in model.state_dict().items()}  # not the model's own tensors
    assert "lm_head.weight" in state
    model.save_pretrained(tmp_path, state_dict=state)
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored and torch.equal(stored["norm.weight"], state["norm.weight"])
    loaded = GPT.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(loaded.embed_tokens.weight, state["embed_tokens.weight"])
    prefixed = dict(state)
    prefixed["module.norm.weight"] = prefixed.pop("norm.weight")  # a wrapper's name
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unexpected \['module.norm.weight'\]"):
        model.save_pretrained(tmp_path / "bad", state_dict=prefixed)
    assert not (tmp_path / "bad").exists()


def test_lora_model_round_trips_with_its_adapters(tmp_path):
    torch.manual_seed(0)
    model = apply_lora(GPT(ModelConfig.from_preset("tiny")), targets=("q", "v", "up"), r=4, alpha=8).eval()
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.lora_B.normal_()  # an adapter that changes the output
    model.save_pretrained(tmp_path)
    loaded = GPT.from_pretrained(tmp_path).eval()
    assert loaded.lora_settings == model.lora_settings
    assert sorted(n for n, p in loaded.named_parameters() if p.requires_grad) == sorted(
        n for n, p in model.named_parameters() if p.requires_grad
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    merged = merge_lora(loaded)
    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(GPT.from_pretrained(tmp_path / "merged").eval()(ids).logits, model(ids).logits)


def _pickle_bytes(path):
    torch.save({"weight": torch.zeros(2)}, path)  # a pickle under the weights' name: never unpickled


def _int64(path):
    save_file({k: v.long() for k, v in load_file(path).items()}, path)


def _lora_settings_lacking(path):
    save_file(load_file(path), path, metadata={"format": "pt", "lora_settings": '{"r": 4, "alpha": 8}'})


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [(_pickle_bytes, r"model\.safetensors: not a readable safetensors file"),
     (_int64, r"model\.safetensors: \S+ is int64, expected a floating-point tensor"),
     (_lora_settings_lacking, r"model\.safetensors: lora_settings metadata lacks targets, dropout")],
    ids=["a pickle", "int64 tensors", "LoRA settings lacking fields"],
)  # fmt: skip
def test_a_damaged_weights_file_is_a_value_error_naming_it(tmp_path, damage, pattern):
    GPT(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path)
    damage(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=pattern):
        GPT.from_pretrained(tmp_path)
