"""The Hugging Face exports against the real transformers and peft: MPT (no custom code), custom code, PEFT LoRA."""

import pytest
import torch

from lmcore import GPT, ModelConfig, apply_lora, generate
from lmcore.hf_mpt import mpt_mismatches

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

MPT_SHAPES = [dict(n_head=4), dict(n_head=6, d_model=96), dict(n_layer=3, n_head=2, d_model=32)]


def exportable(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig.from_preset("tiny", **{"bias": False, **overrides})).eval()


def sharpened(model: GPT) -> GPT:
    """Scale the output head so greedy choices are not near-ties that cached and uncached decoding may break apart."""
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def load_mpt(model: GPT, directory, **kwargs):
    from lmcore.hf_mpt import to_mpt

    to_mpt(model, **kwargs).save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("shape", MPT_SHAPES)
def test_mpt_export_gives_our_logits_beyond_the_training_context(tmp_path, shape):
    model = exportable(**shape)
    hf = load_mpt(model, tmp_path)
    assert type(hf).__name__ == "MptForCausalLM" and hf.config.model_type == "mpt"
    assert hf.config.max_seq_len == 4 * model.config.context_length
    torch.manual_seed(1)
    for length in (17, 3 * model.config.context_length):  # inside, then three times the training context
        ids = torch.randint(0, model.config.vocab_size, (2, length))
        with torch.no_grad():
            ours, theirs = model(ids).logits, hf(ids).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        assert ours.abs().max() > 0.1  # not a vacuous comparison of near-zero logits


def test_mpt_greedy_generation_gives_our_tokens(tmp_path):
    model = sharpened(exportable(seed=3))
    hf = load_mpt(model, tmp_path, eos_token_id=None)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9))
    ours = generate(model, prompt, 60, temperature=0)  # past 2x the context of 32
    for use_cache in (True, False):
        theirs = hf.generate(prompt, max_new_tokens=60, do_sample=False, use_cache=use_cache)
        assert theirs.tolist() == ours.tolist()


def test_mismatches_name_every_field_that_does_not_map():
    assert mpt_mismatches(ModelConfig.from_preset("tiny", bias=False)) == []
    config = ModelConfig.from_preset(
        "tiny", activation="swiglu", n_kv_head=2, tie_embeddings=False, learnable_slopes=True, document_separator=1
    )
    named = [m.split("=")[0] for m in mpt_mismatches(config)]
    expected = ["bias", "activation", "d_ff", "n_kv_head", "tie_embeddings", "learnable_slopes", "document_separator"]
    assert named == expected
    assert mpt_mismatches(ModelConfig.from_preset("tiny", bias=False, norm="rmsnorm")) == [
        "norm='rmsnorm' (MPT: layernorm)"
    ]
    # A rotary model would run as ALiBi in MPT: refused (it exports with lmcore.save_hf as Llama or Qwen2).
    assert mpt_mismatches(ModelConfig.from_preset("tiny", bias=False, position="rope", qkv_bias=True)) == [
        "position='rope' (MPT: ALiBi)",
        "qkv_bias=True (MPT: no biases)",
    ]
    from lmcore.hf_mpt import to_mpt

    with pytest.raises(ValueError, match=r"does not map onto transformers' MPT: bias=True"):
        to_mpt(GPT(ModelConfig.from_preset("tiny")))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(bias=True),  # the default config
        dict(activation="swiglu", n_kv_head=2, tie_embeddings=False, norm="rmsnorm"),
        dict(learnable_slopes=True, document_separator=5),
        dict(
            position="rope",
            qkv_bias=True,
            rope_scaling="llama3",
            rope_factor=4.0,
            rope_original_context=16,
            document_separator=5,
        ),  # fmt: skip
    ],
)
def test_custom_code_export_loads_with_trust_remote_code_and_gives_our_logits(tmp_path, overrides):
    from lmcore.hf_custom import save_custom

    model = sharpened(exportable(**overrides))
    save_custom(model, tmp_path, extra_config={"eos_token_id": 2})
    from transformers.dynamic_module_utils import get_imports

    for code in tmp_path.glob("*.py"):  # self-contained: nothing of ours, no Triton
        assert not {"lmcore", "alibi_kernels", "triton"} & set(get_imports(code)), code.name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(hf).__name__ == "LmcoreForCausalLM" and hf.config.eos_token_id == 2
    ids = torch.randint(0, model.config.vocab_size, (2, 2 * model.config.context_length + 5))
    ids[:, 10] = 5  # a document separator inside the input, for the config that has one
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    prompt = ids[:1, :6]
    assert (
        hf.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
        == generate(model, prompt, 8, temperature=0, eos_id=2).tolist()
    )


def test_custom_code_refuses_padding_and_unmerged_adapters(tmp_path):
    from lmcore.hf_custom import save_custom

    with pytest.raises(ValueError, match="merge_lora"):
        save_custom(apply_lora(exportable()), tmp_path / "lora")
    save_custom(exportable(), tmp_path / "plain")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", trust_remote_code=True)
    with pytest.raises(ValueError, match="no padding"):
        hf(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("q", "v"), ("k", "up", "down")])
def test_lora_adapters_load_in_peft_onto_the_exported_base(tmp_path, targets):
    peft = pytest.importorskip("peft")
    from lmcore.hf_mpt import to_mpt, to_peft

    model = apply_lora(exportable(), targets, r=4, alpha=16)
    with torch.no_grad():  # trained-looking adapters: B = 0 would make the test pass with no adapter at all
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    to_mpt(model).save_pretrained(tmp_path / "base")
    to_peft(model, to_mpt(model), str(tmp_path / "base")).save_pretrained(tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 50))
    with torch.no_grad():
        ours, theirs, plain = model(ids).logits, wrapped(ids).logits, exportable()(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-2  # the adapters change the output, so the comparison means something
