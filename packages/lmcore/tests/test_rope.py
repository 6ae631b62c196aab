"""Rotary positions in the one decoder: config switches, the KV cache, packed documents, the kernels with slope 0."""

import os

import pytest
import torch

import lmcore
from alibi_kernels import alibi_attention
from lmcore import GPT, KVCache, ModelConfig, generate, n_params
from lmcore.model import Packed
from lmcore.rope import apply_rope, inv_freq, positions_in_documents, rotary_cos_sin

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LLAMA = dict(position="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_head=2)
SEP = 2


def tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig.from_preset("tiny", **{**LLAMA, **overrides})).eval()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(position="learned"), "ModelConfig.position must be one of ('alibi', 'rope'), got 'learned'"),
        (
            dict(position="rope", rope_scaling="yarn"),
            "ModelConfig.rope_scaling must be one of ('none', 'linear', 'dynamic', 'llama3'), got 'yarn'",
        ),  # fmt: skip
        (dict(rope_scaling="linear"), "ModelConfig.rope_scaling='linear' needs position='rope'"),
        (dict(position="rope", rope_theta=0), "ModelConfig.rope_theta must be a positive finite number, got 0"),
        (dict(position="rope", rope_factor=float("inf")), "ModelConfig.rope_factor must be a positive finite"),
        (dict(position="rope", rope_original_context=0), "ModelConfig.rope_original_context must be a positive int"),
        (dict(position="rope", learnable_slopes=True), "ModelConfig.learnable_slopes=True needs position='alibi'"),
        (
            dict(position="rope", rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0),
            "ModelConfig.rope_high_freq_factor=4.0 must exceed rope_low_freq_factor=4.0",
        ),  # fmt: skip
        (dict(position="rope", n_head=2, d_model=34), "ModelConfig.d_model / n_head = 17 must be even"),
        (dict(qkv_bias="yes"), "ModelConfig.qkv_bias must be a bool, got 'yes'"),
    ],
)
def test_bad_rope_settings_are_one_line_errors_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_preset("tiny", **overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_defaults_keep_alibi_and_every_preset_unchanged():
    config = ModelConfig.from_preset("tiny")
    assert (config.position, config.rope_scaling, config.qkv_bias) == ("alibi", "none", False)
    torch.manual_seed(0)
    model = GPT(config)
    assert model.layers[0].self_attn.head_slopes().min() > 0  # ALiBi's slopes, not zeros


def test_qkv_bias_puts_biases_on_q_k_v_only():
    model = tiny(qkv_bias=True)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attn.o_proj.bias is None and mlp.up_proj.bias is None and mlp.down_proj.bias is None
    assert sum(p.numel() for p in model.parameters()) == n_params(model.config)


def test_rope_changes_the_function_and_is_relative():
    """Shifting every position by the same amount leaves q.k unchanged (RoPE depends on i - j only)."""
    config = ModelConfig.from_preset("tiny", **LLAMA)
    q, k = torch.randn(1, 6, 4, 16, dtype=torch.float64), torch.randn(1, 6, 4, 16, dtype=torch.float64)
    scores = []
    for shift in (0, 37):
        cos, sin = rotary_cos_sin(config, torch.arange(shift, shift + 6)[None], 6, torch.float64)
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores.append(torch.einsum("bthd,bshd->bhts", qr, kr))
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-4, atol=1e-5)  # angles in float32, as transformers
    assert (scores[0] - torch.einsum("bthd,bshd->bhts", q, k)).abs().max() > 1e-2  # the rotation does something


def test_scalings_follow_their_formulas():
    base = dict(LLAMA, context_length=16)
    plain = inv_freq(ModelConfig.from_preset("tiny", **base))
    linear = inv_freq(ModelConfig.from_preset("tiny", **base, rope_scaling="linear", rope_factor=4.0))
    torch.testing.assert_close(linear, plain / 4.0)
    dynamic = ModelConfig.from_preset("tiny", **base, rope_scaling="dynamic", rope_factor=2.0)
    torch.testing.assert_close(inv_freq(dynamic, 16), plain)  # up to the original context: unchanged
    longer = inv_freq(dynamic, 64)
    theta = 10000.0 * (2.0 * 64 / 16 - 1) ** (16 / 14)
    torch.testing.assert_close(longer, 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16))
    llama3 = inv_freq(ModelConfig.from_preset("tiny", **base, rope_scaling="llama3", rope_factor=8.0))
    wavelength = 2 * torch.pi / plain
    assert torch.equal(llama3[wavelength < 16 / 4], plain[wavelength < 16 / 4])  # high frequencies kept
    torch.testing.assert_close(llama3[wavelength > 16], plain[wavelength > 16] / 8.0)  # low ones divided


def test_positions_restart_after_each_separator():
    ids = torch.tensor([[5, SEP, 7, 8, SEP, SEP, 9], [SEP, 3, 4, 5, 6, 7, 8]])
    assert positions_in_documents(ids, SEP).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_cached_decoding_continues_positions_past_the_cache():
    """(Dynamic NTK rotates each step's keys with the base of that step's length and the cache keeps them, as
    transformers' cache does: tests/test_hf_import.py compares that with transformers' own generation.)"""
    model = tiny(context_length=16)
    length = 3 * model.config.context_length + 5
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    full = model(ids).logits
    cache = KVCache(model.config.n_layer)
    prefill = length - 10
    pieces = [model(ids[:, :prefill], kv_cache=cache).logits]
    pieces += [model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(prefill, length - 3)]
    pieces += [model(ids[:, length - 3 :], kv_cache=cache).logits]
    assert len(cache) == length
    # A step whose positions restarted at 0 (the bug a cache invites) would break this equality.
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


def test_generate_with_the_cache_equals_greedy_recomputation():
    model = tiny(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # no near-ties between the cached and recomputed paths
    prompt = torch.randint(0, model.config.vocab_size, (2, 7))
    out = generate(model, prompt, 40, temperature=0)  # past the training context of 32
    ids = prompt
    for _ in range(40):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tolist() == ids.tolist()


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1"))],
)
def test_packed_documents_restart_positions_and_stay_inside(backend):
    plain = tiny(attention_backend=backend)
    docs = tiny(attention_backend=backend, document_separator=SEP)
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(3, 97, (n,), generator=g) for n in (5, 7, 4)]
    parts = [torch.cat([parts[0], torch.tensor([SEP])]), torch.cat([parts[1], torch.tensor([SEP])]), parts[2]]
    row = torch.cat(parts)[None]  # (1, 18)
    with torch.no_grad():
        packed = docs(row).logits[0]
        start = 0
        for part in parts:
            alone = plain(part[None]).logits[0]  # positions from 0, nothing before
            torch.testing.assert_close(packed[start : start + len(part)], alone, rtol=1e-5, atol=1e-5)
            start += len(part)
        leaky = plain(row).logits[0]
    assert (leaky[6:] - packed[6:]).abs().max() > 1e-3  # without the separator the documents would mix


def test_packed_documents_rotate_each_from_position_0():
    """Attention inside a document sees only relative angles, so the restart shows in the angles themselves (and in
    dynamic NTK's length, the longest document's, as transformers takes it from packed position_ids)."""
    model = tiny(document_separator=SEP)
    row = torch.tensor([[5, 6, SEP, 7, 8, 9, SEP, 4]])
    documents = Packed(lmcore.document_starts(row, SEP))
    cos, sin = model._rotary(row, None, documents, torch.float32)  # (1, 8, D)
    starts = [0, 3, 7]
    assert torch.equal(cos[0, starts], torch.ones(3, 16)) and torch.equal(sin[0, starts], torch.zeros(3, 16))
    assert not torch.equal(cos[0, 1], torch.ones(16))


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
def test_the_triton_kernels_with_zero_slopes_are_plain_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    zeros = torch.zeros(4)
    fused = alibi_attention(q, k, v, zeros, backend="triton")
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(fused.double(), reference, rtol=1e-5, atol=1e-5)
    model_torch, model_triton = tiny(), tiny(attention_backend="triton")
    ids = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(model_triton(ids).logits, model_torch(ids).logits, rtol=1e-5, atol=1e-5)


def test_slopes_are_zeros_after_a_bf16_cast_and_no_state_dict_entry():
    model = tiny().to(torch.bfloat16)
    ids = torch.randint(0, 97, (1, 8))
    assert model(ids).logits.dtype == torch.bfloat16
    slopes = model.layers[0].self_attn.head_slopes()
    assert slopes.dtype == torch.float32 and torch.equal(slopes, torch.zeros(4))
    assert not any("slope" in key for key in model.state_dict())


def test_checkpointing_with_rope_gives_the_same_gradients():
    plain, ckpt = tiny(), tiny(checkpointing="block")
    plain.train(), ckpt.train()
    ids = torch.randint(0, 97, (2, 16))
    plain(ids, ids).loss.backward()
    ckpt(ids, ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_dynamic_scaling_of_packed_documents_takes_the_longest_document():
    """transformers takes dynamic NTK's length from packed position_ids: max(position) + 1, the longest document."""
    model = tiny(document_separator=SEP, rope_scaling="dynamic", rope_factor=2.0, context_length=8)
    row = torch.tensor([[5] * 11 + [SEP] + [6, 7, SEP] + [8] * 9])  # documents of 12, 3 and 9 tokens, T = 24
    positions = positions_in_documents(row, SEP)
    cos, sin = model._rotary(row, None, Packed(lmcore.document_starts(row, SEP)), torch.float32)
    for got, want in zip((cos, sin), rotary_cos_sin(model.config, positions, 12, torch.float32), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(cos, rotary_cos_sin(model.config, positions, 24, torch.float32)[0])
