"""lmcore.finetune_memory: parameter counts against models built, NF4 bytes against torchao's tensors, activations
against the bytes autograd saves, and the three methods' accounting on Qwen2-1.5B's shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmcore import GPT, ModelConfig, apply_lora, estimate_finetune_memory, n_params
from lmcore.finetune_memory import (
    activation_bytes_per_layer,
    attention_kernel_bytes,
    finetune_activation_bytes,
    lora_parameters,
    nf4_bytes,
)
from lmcore.hf_llama import config_from_hf

GIB = 2**30
# The shape fields of Qwen2-1.5B's published config.json (Qwen2ForCausalLM; q, k and v carry biases in every Qwen2).
QWEN2_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
}
TINY_QWEN2 = {**QWEN2_1_5B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256}  # fmt: skip
LLAMA_LIKE = ModelConfig(vocab_size=512, n_layer=3, n_head=4, n_kv_head=2, d_model=128, d_ff=320, context_length=256,
                         norm="rmsnorm", activation="swiglu", position="rope", bias=False, qkv_bias=True,
                         dropout=0.0)  # fmt: skip
GPT_LIKE = ModelConfig(vocab_size=512, n_layer=3, n_head=4, d_model=128, context_length=256, dropout=0.0)


def test_qwen2_1_5b_counts_and_what_each_method_holds():
    cfg = config_from_hf(QWEN2_1_5B)
    psi = n_params(cfg)
    # Per layer: q 1536^2 + 1536, k and v 1536*256 + 256 each, o 1536^2, MLP 3*1536*8960, two norms; the embedding
    # (tied) and the final norm once.
    per_layer = 2 * 1536**2 + 2 * 1536 * 256 + 1536 + 2 * 256 + 3 * 1536 * 8960 + 2 * 1536
    assert psi == 28 * per_layer + 151936 * 1536 + 1536 == 1_543_714_304
    full = estimate_finetune_memory(cfg, "full", 1, 1024)
    assert (full.weights, full.gradients, full.optimizer_states) == (2 * psi, 2 * psi, 12 * psi)
    assert full.weights + full.gradients + full.optimizer_states > 22 * GIB  # 16 bytes per parameter: 23.0 GiB
    lora = estimate_finetune_memory(cfg, "lora", 1, 1024, lora_r=8)
    adapters = 28 * 8 * (2 * (1536 + 1536) + 2 * (1536 + 256))  # q, o: 1536 -> 1536; k, v: 1536 -> 256
    assert lora.trainable == adapters == 2_179_072
    assert lora.weights == 2 * psi + 4 * adapters and lora.optimizer_states == 8 * adapters
    qlora = estimate_finetune_memory(cfg, "qlora", 1, 1024, lora_r=8)
    linears = 2 * 1536**2 + 2 * 1536 * 256 + 3 * 1536 * 8960
    assert 0.515 * 28 * linears < qlora.weights - 2 * (psi - 28 * linears) - 4 * adapters < 0.517 * 28 * linears
    assert qlora.gathered == 2 * 1536 * 8960  # one MLP weight dequantized to bf16
    # FSDP over 2: the states halve, two blocks and the root are gathered.
    lora2 = estimate_finetune_memory(cfg, "lora", 1, 1024, world_size=2, lora_r=8)
    assert lora2.weights == psi + 2 * adapters and lora2.gathered > 2 * 151936 * 1536
    full2 = estimate_finetune_memory(cfg, "full", 1, 1024, world_size=2)
    assert full2.weights + full2.gradients + full2.optimizer_states == 16 * psi // 2


def test_parameter_counts_equal_the_models_built():
    for cfg in (LLAMA_LIKE, GPT_LIKE, config_from_hf(TINY_QWEN2)):
        model = GPT(cfg)
        assert estimate_finetune_memory(cfg, "full", 1, 8).n_params == sum(p.numel() for p in model.parameters())
        for targets in (("q", "k", "v", "o"), ("mlp",), ("q", "v", "down")):
            apply_lora(model := GPT(cfg), targets, r=4)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            assert lora_parameters(cfg, 4, targets) == trainable
            assert estimate_finetune_memory(cfg, "lora", 1, 8, lora_r=4, lora_targets=targets).trainable == trainable


def test_parameter_count_equals_transformers_qwen2():
    transformers = pytest.importorskip("transformers", reason="transformers (the hf extra) builds the reference")
    config = transformers.Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k not in ("architectures",)})
    reference = transformers.Qwen2ForCausalLM(config)
    counted = sum(p.numel() for p in reference.parameters())  # a tied head is one parameter
    assert estimate_finetune_memory(config_from_hf(TINY_QWEN2), "full", 1, 8).n_params == counted


@pytest.mark.parametrize("shape", [(64, 64), (256, 1024), (320, 128), (96, 64)])
def test_nf4_bytes_equal_what_torchao_stores(shape):
    pytest.importorskip("torchao", reason="torchao (the qlora extra) stores NF4")
    from lmcore.qlora import NF4Linear

    layer = NF4Linear(nn.Linear(*shape, bias=False))
    assert nf4_bytes(shape[0] * shape[1]) == layer.quantized_bytes()


def test_qlora_base_bytes_equal_a_quantized_model():
    pytest.importorskip("torchao", reason="torchao (the qlora extra) stores NF4")
    from lmcore.qlora import NF4Linear, quantize_frozen_linears

    model = quantize_frozen_linears(apply_lora(GPT(LLAMA_LIKE), r=4))
    nf4 = [m for m in model.modules() if isinstance(m, NF4Linear)]
    stored = sum(m.quantized_bytes() for m in nf4)
    others = n_params(LLAMA_LIKE) - sum(m.in_features * m.out_features for m in nf4)  # embeddings, norms, biases
    adapters = lora_parameters(LLAMA_LIKE, 4)
    est = estimate_finetune_memory(LLAMA_LIKE, "qlora", 1, 8, lora_r=4)
    assert len(nf4) == 7 * LLAMA_LIKE.n_layer
    assert est.weights == stored + 2 * others + 4 * adapters


def _saved_bytes(model: GPT, batch: int, seq: int) -> int:
    """Bytes autograd keeps for the backward of one forward with labels (the logits too, which the caller holds),
    leaving out the parameters and what the attention core saves (its CPU path is not the GPU kernel)."""
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    inside, seen = [False], {}
    for layer in model.layers:
        core = layer.self_attn._core

        def marked(*args, _core=core):
            inside[0] = True
            try:
                return _core(*args)
            finally:
                inside[0] = False

        layer.self_attn._core = marked

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not inside[0]:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    return sum(seen.values()) + (0 if out.logits is None else out.logits.numel() * out.logits.element_size())


@pytest.mark.parametrize("base", [LLAMA_LIKE, GPT_LIKE], ids=["rmsnorm-swiglu-rope", "layernorm-gelu-alibi"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("checkpointing", ["off", "block"])
def test_activations_equal_what_autograd_saves(base, method, checkpointing):
    """In bf16 on the CPU, within 1% (the rotary cos/sin tables and the loss are not counted). Off: the forward
    saves everything but the kernel's share, added here; block: the forward saves the block inputs, and the
    backward rebuilds one block, added here."""
    cfg = ModelConfig(**{**base.to_dict(), "checkpointing": checkpointing})
    model = GPT(cfg).train()
    if method == "lora":
        apply_lora(model, r=8)
    batch, seq = 2, 128
    saved = _saved_bytes(model.to(torch.bfloat16), batch, seq)
    tokens = batch * seq
    rest = cfg.n_layer * attention_kernel_bytes(cfg, tokens) if checkpointing == "off" else \
        activation_bytes_per_layer(cfg, tokens, method)  # fmt: skip
    estimate = finetune_activation_bytes(cfg, batch, seq, method, checkpointing)
    assert estimate == pytest.approx(saved + rest, rel=0.01)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_labelled_loss_keeps_what_the_estimate_says(method):
    """loss_logits "labelled": the forward keeps the blocks' activations, the final hidden states and labels, and no
    logits; the estimate adds one chunk's logits and final norm, rebuilt in the backward (not saved by the forward)."""
    from lmcore.finetune_memory import _norm_bytes
    from lmcore.model import LOSS_CHUNK_ROWS

    cfg = ModelConfig(**{**LLAMA_LIKE.to_dict(), "loss_logits": "labelled"})
    model = GPT(cfg).train()
    if method == "lora":
        apply_lora(model, r=8)
    batch, seq = 2, 128
    tokens = batch * seq
    saved = _saved_bytes(model.to(torch.bfloat16), batch, seq) + cfg.n_layer * attention_kernel_bytes(cfg, tokens)
    final_norm = _norm_bytes(cfg, method == "full") + (2 * cfg.d_model if method == "full" else 0)
    rebuilt = min(tokens, LOSS_CHUNK_ROWS) * (final_norm + 6 * cfg.vocab_size)
    estimate = finetune_activation_bytes(cfg, batch, seq, method)
    assert estimate - rebuilt == pytest.approx(saved, rel=0.01)
    # At finetune's default 8 rows of 1024 tokens of Qwen2-1.5B, 3/4 of the B x T x V logits are no longer held.
    qwen2, rows = config_from_hf(QWEN2_1_5B), 8 * 1024
    held = [finetune_activation_bytes(qwen2, 8, 1024, method, loss_logits=k) for k in ("all", "labelled")]
    assert held[0] - held[1] > 0.75 * rows * 6 * qwen2.vocab_size


def test_checkpointing_and_batch_scale_the_activations():
    cfg = config_from_hf(QWEN2_1_5B)
    off = estimate_finetune_memory(cfg, "lora", 2, 512)
    block = estimate_finetune_memory(cfg, "lora", 2, 512, checkpointing="block")
    assert block.activations < off.activations / 2 and block.weights == off.weights
    assert estimate_finetune_memory(cfg, "lora", 4, 512).activations == 2 * off.activations
    assert finetune_activation_bytes(cfg, 1, 1024, "full") > finetune_activation_bytes(cfg, 1, 1024, "lora")


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "dora"}, "method must be one of ('full', 'lora', 'qlora'), got 'dora'"),
    ({"checkpointing": "attention"}, "checkpointing must be one of ('off', 'block'), got 'attention'"),
    ({"micro_batch": 0}, "micro_batch must be a positive int, got 0"),
    ({"world_size": 1.5}, "world_size must be a positive int, got 1.5"),
    ({"lora_targets": ("qkv",)}, "unknown LoRA target 'qkv'"),
    ({"lora_r": 0}, "LoRA rank r must be a positive int, got 0"),
])  # fmt: skip
def test_bad_arguments_name_the_field(kwargs, message):
    args = {"config": LLAMA_LIKE, "method": "lora", "micro_batch": 1, "seq_len": 8, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate_finetune_memory(**args)
