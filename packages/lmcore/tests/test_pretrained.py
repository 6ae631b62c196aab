import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmcore import GPT, ModelConfig, apply_lora


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


def test_lora_model_must_be_merged_before_save(tmp_path):
    with pytest.raises(ValueError, match="merge_lora"):
        apply_lora(GPT(ModelConfig.from_preset("tiny"))).save_pretrained(tmp_path)
