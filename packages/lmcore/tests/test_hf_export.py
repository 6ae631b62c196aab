"""The Hugging Face exports against the real transformers and peft: MPT (no custom code), custom code, PEFT LoRA;
every tensor each writes compared with the model's (names, shapes, values), and the logits of what loads."""

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


def randomised(model: GPT) -> GPT:
    """Every parameter random (norms start at ones, biases at zeros), so no two tensors are alike and a swapped or
    transposed one shows in a comparison of values."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model


def saved_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_tensors(stored: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and under each the same shape and the same values, exactly."""
    assert sorted(stored) == sorted(want)
    for name, ours in want.items():
        assert stored[name].shape == ours.shape, (name, tuple(stored[name].shape), tuple(ours.shape))
        torch.testing.assert_close(stored[name], ours.detach(), rtol=0, atol=0, msg=name)


def mpt_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """MPT's weights for `model`, named here from its modules (not through `mpt_state_dict`): embedding `wte` (the
    head is tied and not stored), per block `norm_1`, the fused `Wqkv` (q rows, then k, then v), `out_proj`,
    `norm_2`, `ffn.up_proj`, `ffn.down_proj`; the final `norm_f`."""

    def w(layer):
        return layer.base.weight if hasattr(layer, "base") else layer.weight  # a LoRA layer's base

    want = {"transformer.wte.weight": model.embed_tokens.weight, "transformer.norm_f.weight": model.norm.weight}
    for i, block in enumerate(model.layers):
        attn, prefix = block.self_attn, f"transformer.blocks.{i}."
        want |= {
            prefix + "norm_1.weight": block.attn_norm.weight,
            prefix + "attn.Wqkv.weight": torch.cat([w(attn.q_proj), w(attn.k_proj), w(attn.v_proj)]),
            prefix + "attn.out_proj.weight": w(attn.o_proj),
            prefix + "norm_2.weight": block.mlp_norm.weight,
            prefix + "ffn.up_proj.weight": w(block.mlp.up_proj),
            prefix + "ffn.down_proj.weight": w(block.mlp.down_proj),
        }
    return want


def load_mpt(model: GPT, directory, **kwargs):
    from lmcore.hf_mpt import to_mpt

    to_mpt(model, **kwargs).save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("shape", MPT_SHAPES)
def test_mpt_export_gives_our_logits_beyond_the_training_context(tmp_path, shape):
    model = randomised(exportable(**shape))
    hf = load_mpt(model, tmp_path)
    assert_same_tensors(saved_tensors(tmp_path / "model.safetensors"), mpt_tensors(model))
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

    model = sharpened(randomised(exportable(**overrides)))
    save_custom(model, tmp_path, extra_config={"eos_token_id": 2})
    # The model's own parameters under `model.`, the tied head once (named_parameters lists a shared one once).
    want = {f"model.{name}": p for name, p in model.named_parameters()}
    assert ("model.lm_head.weight" in want) == (not model.config.tie_embeddings)
    assert_same_tensors(saved_tensors(tmp_path / "model.safetensors"), want)
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
    lengths = []  # the positions each forward of the decoder runs: with the cache, the prompt then one at a time
    hook = hf.model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    assert (
        hf.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
        == generate(model, prompt, 8, temperature=0, eos_id=2).tolist()
    )
    hook.remove()
    cached = model.config.document_separator is None  # attention inside documents needs the whole sequence
    assert lengths == ([6] + [1] * 7 if cached else list(range(6, 14))), lengths


def test_custom_code_refuses_padding_and_unmerged_adapters(tmp_path):
    from lmcore.hf_custom import save_custom

    with pytest.raises(ValueError, match="merge_lora"):
        save_custom(apply_lora(exportable()), tmp_path / "lora")
    save_custom(exportable(), tmp_path / "plain")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", trust_remote_code=True)
    with pytest.raises(ValueError, match="no padding"):
        hf(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))


def peft_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The adapter tensors PEFT's file must hold for `model` on its MPT export: `lora_A` (r, in) and `lora_B`
    (out, r) of each targeted MPT module; on the fused `Wqkv`, one adapter of rank r x (number of q, k, v targeted):
    their A matrices stacked in q, k, v order, each B in its projection's rows (q, k, v) and its own r columns."""
    r, d = model.lora_settings["r"], model.config.d_model
    want = {}
    for i, block in enumerate(model.layers):
        prefix, attn = f"base_model.model.transformer.blocks.{i}.", block.self_attn
        qkv = [(row, m) for row, m in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)) if hasattr(m, "lora_A")]
        if qkv:
            b = torch.zeros(3 * d, r * len(qkv))
            for slot, (row, m) in enumerate(qkv):
                b[row * d : (row + 1) * d, slot * r : (slot + 1) * r] = m.lora_B
            want[prefix + "attn.Wqkv.lora_A.weight"] = torch.cat([m.lora_A for _, m in qkv])
            want[prefix + "attn.Wqkv.lora_B.weight"] = b
        for layer, path in ((attn.o_proj, "attn.out_proj"), (block.mlp.up_proj, "ffn.up_proj"),
                            (block.mlp.down_proj, "ffn.down_proj")):  # fmt: skip
            if hasattr(layer, "lora_A"):
                want[f"{prefix}{path}.lora_A.weight"] = layer.lora_A
                want[f"{prefix}{path}.lora_B.weight"] = layer.lora_B
    return want


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("q", "v"), ("k", "up", "down")])
def test_lora_adapters_load_in_peft_onto_the_exported_base(tmp_path, targets):
    peft = pytest.importorskip("peft")
    from lmcore.hf_mpt import to_mpt, to_peft

    model = apply_lora(randomised(exportable()), targets, r=4, alpha=16)
    with torch.no_grad():  # trained-looking adapters: B = 0 would make the test pass with no adapter at all
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    to_mpt(model).save_pretrained(tmp_path / "base")
    to_peft(model, to_mpt(model), str(tmp_path / "base")).save_pretrained(tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert_same_tensors(saved_tensors(tmp_path / "base" / "model.safetensors"), mpt_tensors(model))
    assert_same_tensors(saved_tensors(tmp_path / "adapter" / "adapter_model.safetensors"), peft_tensors(model))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 50))
    with torch.no_grad():
        ours, theirs, plain = model(ids).logits, wrapped(ids).logits, randomised(exportable())(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-2  # the adapters change the output, so the comparison means something


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("v", "up", "down")])
def test_lora_adapters_load_in_peft_onto_the_custom_code_base(tmp_path, targets):
    # The default presets have biases, so their export is custom code: its adapters in PEFT's layout too.
    peft = pytest.importorskip("peft")
    from lmcore.hf_custom import save_custom

    model = apply_lora(randomised(exportable(bias=True, activation="swiglu", n_kv_head=2)), targets, r=4, alpha=16)
    with torch.no_grad():  # trained-looking adapters: B = 0 would make the test pass with no adapter at all
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    save_custom(model, tmp_path / "base", adapter_dir=tmp_path / "adapter")

    def frozen(layer):
        return layer.base if hasattr(layer, "base") else layer

    want = {}  # the base: every parameter under the plain model's name, an adapted layer's frozen weight and bias
    for name, module in model.named_modules():
        if name and not hasattr(module, "lora_A") and not name.endswith(".base"):
            for leaf, p in module.named_parameters(recurse=False):
                want[f"model.{name}.{leaf}"] = p
        if hasattr(module, "lora_A"):
            want |= {f"model.{name}.{leaf}": p for leaf, p in frozen(module).named_parameters()}
    want.pop("model.lm_head.weight", None)  # tied: stored once, as the embedding
    assert_same_tensors(saved_tensors(tmp_path / "base" / "model.safetensors"), want)
    adapters = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            adapters[f"base_model.model.model.{name}.lora_A.weight"] = module.lora_A
            adapters[f"base_model.model.model.{name}.lora_B.weight"] = module.lora_B
    assert_same_tensors(saved_tensors(tmp_path / "adapter" / "adapter_model.safetensors"), adapters)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", trust_remote_code=True)
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 50))
    with torch.no_grad():
        ours = model(ids).logits
        plain = randomised(exportable(bias=True, activation="swiglu", n_kv_head=2))(ids).logits
        theirs = wrapped(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-2  # the adapters change the output, so the comparison means something
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_custom(exportable(), tmp_path / "plain", adapter_dir=tmp_path / "nothing")
