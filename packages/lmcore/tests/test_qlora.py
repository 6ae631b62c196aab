"""QLoRA: NF4 base weights within the format's error, a state dict that reads back as LoRA, and a loss that falls."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from lmcore import GPT, ModelConfig, apply_lora
from lmcore.lora import lora_modules

qlora = pytest.importorskip("lmcore.qlora")
pytest.importorskip("torchao")


def _block_bound(w: torch.Tensor, deq_scales: torch.Tensor) -> torch.Tensor:
    """Per weight: half the widest NF4 code gap times its block's true absmax, plus how far the stored
    (int8-quantized) scale is from that absmax (a code is at most 1 in size)."""
    blocks = w.flatten().view(-1, qlora.NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    bound = qlora.NF4_MAX_HALF_GAP * absmax + (absmax - deq_scales.view(-1, 1)).abs()
    return bound.expand_as(blocks).reshape(w.shape)


@pytest.mark.parametrize("shape", [(256, 128), (64, 64), (192, 64)])
def test_dequantized_weights_within_the_format_error(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer = qlora.NF4Linear(linear)
    w = linear.weight.detach()
    deq = layer.dequantized()
    scales = layer.weight.dequantize_scalers(
        layer.weight.quantized_scalers, layer.weight.quantization_factor, layer.weight.scaler_block_size
    )
    err = (deq - w).abs()
    assert (err <= _block_bound(w, scales) * (1 + 1e-6) + 1e-7).all()
    assert err.max() > 0  # it is quantized
    assert layer.quantized_bytes() <= 0.3 * 2 * w.numel()  # under 0.3x of bf16


def test_forward_and_state_dict_read_back_as_lora():
    torch.manual_seed(0)
    model = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4)
    qlora.quantize_frozen_linears(model)
    assert type(model.layers[0].self_attn.q_proj.base).__name__ == "NF4Linear"
    state = model.state_dict()
    assert state["layers.0.self_attn.q_proj.base.weight"].dtype == torch.float32
    # A plain LoRA model loading that state computes what the quantized one does.
    plain = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4)
    plain.load_state_dict(state)
    ids = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(plain.eval()(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    sizes = qlora.base_weight_bytes(model)
    assert sizes["stored"] <= 0.3 * sizes["bf16"]


def test_qlora_loss_falls_and_only_adapters_move():
    torch.manual_seed(0)
    model = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4, alpha=8)
    qlora.quantize_frozen_linears(model)
    codes = model.layers[0].self_attn.q_proj.base.weight.quantized_data.clone()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 97, (4, 24))
    losses = []
    for _ in range(20):
        loss = model(ids[:, :-1], ids[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert torch.equal(model.layers[0].self_attn.q_proj.base.weight.quantized_data, codes)
    assert len(lora_modules(model)) == 8


@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (128, 64), (64, 96), (576, 576), (256, 1536), (8960, 1536)])
def test_scale_blocks_split_into_whole_blocks_over_2_4_8_ranks(shape):
    numel = shape[0] * shape[1]
    blocks, scales = numel // qlora.NF4_BLOCK, qlora.scaler_block_for(numel)
    assert blocks % scales == 0 and scales <= qlora.NF4_SCALER_BLOCK and (blocks // scales) % 8 == 0
    if blocks % (qlora.NF4_SCALER_BLOCK * 8) == 0:
        assert scales == qlora.NF4_SCALER_BLOCK  # a layer of a real model keeps the QLoRA paper's 256
    if numel > 256 * 1024:
        return  # dequantizing the large ones below is slow and shows nothing new
    torch.manual_seed(0)
    layer = qlora.NF4Linear(torch.nn.Linear(shape[1], shape[0], bias=False))
    whole = layer.dequantized()
    for ranks in (2, 4, 8):
        # FSDP's fully_shard cuts each NF4 weight with torch.chunk on its rows: every shard is a valid NF4 tensor of
        # whole scale blocks, holding exactly its rows of the layer's weight.
        shards = torch.chunk(layer.weight.detach(), ranks, dim=0)
        assert [tuple(s.shape) for s in shards] == [(shape[0] // ranks, shape[1])] * ranks
        assert torch.equal(torch.cat([s.get_original_weight() for s in shards]), whole)
        assert sum(s.quantized_data.numel() for s in shards) == layer.weight.quantized_data.numel()


def test_a_layer_too_small_for_8_ranks_takes_the_largest_split_it_allows():
    assert qlora.scaler_block_for(12 * 64) == 3  # 12 blocks: 4 scale blocks of 3 (8 does not divide 12, 4 does)
    assert qlora.scaler_block_for(3 * 64) == 3  # 3 blocks: one scale block (no power of two above 1 divides 3)


def _mapped(path) -> bool:
    """Whether this process maps ``path`` into memory (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_quantizing_a_from_hf_model_releases_the_mapped_base_file(tmp_path):
    pytest.importorskip("transformers")
    from hf_checkpoints import write_checkpoint
    from safetensors.torch import load_file

    from lmcore import from_hf

    write_checkpoint(tmp_path, "Qwen2ForCausalLM")  # q/k/v biases and norms: frozen tensors that stay unquantized
    path = (tmp_path / "model.safetensors").resolve()
    model = apply_lora(from_hf(tmp_path), r=4)
    gc.collect()
    assert _mapped(path)  # from_hf's tensors are views of the file
    qlora.quantize_frozen_linears(model)
    gc.collect()
    # The pages of the weights replaced by NF4 copies no longer stay resident through a mapping the rest holds.
    assert not _mapped(path)
    state = load_file(path)
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(model.layers[0].self_attn.k_proj.base.bias, state["model.layers.0.self_attn.k_proj.bias"])
