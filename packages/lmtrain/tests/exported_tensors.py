"""What each export must hold, tensor by tensor, named here from the model's modules (not through the exporters'
own mappings), and the comparison of a written file against it: the same names, shapes and values.

`mpt_tensors`: transformers' MPT (`--format hf` of a bias-free model), the head tied and not stored.
`custom_tensors`: the custom-code export, the model's parameters under `model.`.
`custom_base_tensors`, `custom_peft_tensors`: a LoRA model's custom-code base and its PEFT adapter file.
`peft_tensors`: PEFT's adapter file on the MPT export (q, k and v adapters fused into one on `Wqkv`).
`gguf_tensors`: llama.cpp's MPT names, numpy's (out, in) order.
"""

from __future__ import annotations

import numpy as np
import torch


def _weight(layer) -> torch.Tensor:
    return layer.base.weight if hasattr(layer, "base") else layer.weight  # a LoRA layer's base weight


def mpt_tensors(model) -> dict[str, torch.Tensor]:
    """Embedding `wte`; per block `norm_1`, the fused `Wqkv` (q rows, then k, then v), `out_proj`, `norm_2`,
    `ffn.up_proj`, `ffn.down_proj`; the final `norm_f`."""
    want = {"transformer.wte.weight": model.embed_tokens.weight, "transformer.norm_f.weight": model.norm.weight}
    for i, block in enumerate(model.layers):
        attn, prefix = block.self_attn, f"transformer.blocks.{i}."
        want |= {
            prefix + "norm_1.weight": block.attn_norm.weight,
            prefix + "attn.Wqkv.weight": torch.cat([_weight(attn.q_proj), _weight(attn.k_proj), _weight(attn.v_proj)]),
            prefix + "attn.out_proj.weight": _weight(attn.o_proj),
            prefix + "norm_2.weight": block.mlp_norm.weight,
            prefix + "ffn.up_proj.weight": _weight(block.mlp.up_proj),
            prefix + "ffn.down_proj.weight": _weight(block.mlp.down_proj),
        }
    return {k: v.detach() for k, v in want.items()}


def custom_tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters under `model.` (a tied head is one parameter, listed once as the embedding)."""
    return {f"model.{name}": p.detach() for name, p in model.named_parameters()}


def custom_base_tensors(model) -> dict[str, torch.Tensor]:
    """The custom-code base under a LoRA model: every parameter under the plain model's name (an adapted layer's
    frozen weight and bias under the layer's own), no adapter; the tied head once, as the embedding."""
    want = {}
    for name, module in model.named_modules():
        adapted = hasattr(module, "lora_A")
        if adapted:
            want |= {f"model.{name}.{leaf}": p.detach() for leaf, p in module.base.named_parameters()}
        elif name and not name.endswith(".base"):
            want |= {f"model.{name}.{leaf}": p.detach() for leaf, p in module.named_parameters(recurse=False)}
    if model.config.tie_embeddings:
        want.pop("model.lm_head.weight", None)
    return want


def custom_peft_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT's adapter file on the custom-code base: `lora_A` and `lora_B` of each adapted layer, under its module."""
    want = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            want[f"base_model.model.model.{name}.lora_A.weight"] = module.lora_A.detach()
            want[f"base_model.model.model.{name}.lora_B.weight"] = module.lora_B.detach()
    return want


def peft_tensors(model) -> dict[str, torch.Tensor]:
    """`lora_A` (r, in) and `lora_B` (out, r) of each targeted MPT module; on `Wqkv` one adapter of rank r x (the
    number of q, k, v targeted): their A stacked in q, k, v order, each B in its projection's rows, its own columns."""
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
    return {k: v.detach() for k, v in want.items()}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp's MPT: `token_embd`, per block `attn_norm`, `attn_qkv` (q, k, v rows), `attn_output`, `ffn_norm`,
    `ffn_up`, `ffn_down` (weights and, where the model has them, biases); `output_norm`; `output` when untied."""

    def a(t):
        return t.detach().float().numpy()

    want = {"token_embd.weight": a(model.embed_tokens.weight)}
    for i, block in enumerate(model.layers):
        attn, mlp = block.self_attn, block.mlp
        modules = {"attn_norm": block.attn_norm, "attn_output": attn.o_proj, "ffn_norm": block.mlp_norm,
                   "ffn_up": mlp.up_proj, "ffn_down": mlp.down_proj}  # fmt: skip
        for kind in ("weight", "bias"):
            qkv = [getattr(m, kind) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
            if qkv[0] is not None:
                want[f"blk.{i}.attn_qkv.{kind}"] = np.concatenate([a(t) for t in qkv])
            want |= {
                f"blk.{i}.{n}.{kind}": a(getattr(m, kind)) for n, m in modules.items() if getattr(m, kind) is not None
            }
    want["output_norm.weight"] = a(model.norm.weight)
    if model.norm.bias is not None:
        want["output_norm.bias"] = a(model.norm.bias)
    if not model.config.tie_embeddings:
        want["output.weight"] = a(model.lm_head.weight)
    return want


def assert_same_tensors(stored: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and under each the same shape and exactly the same values."""
    assert sorted(stored) == sorted(want)
    for name, ours in want.items():
        assert stored[name].shape == ours.shape, (name, tuple(stored[name].shape), tuple(ours.shape))
        torch.testing.assert_close(stored[name], ours, rtol=0, atol=0, msg=name)


def assert_gguf_holds(reader, model, outtype: str) -> None:
    """Every tensor of a GGUF file (gguf's reader) against the model's: names, shapes in numpy order, values (2-D
    weights rounded to float16 in an f16 file, exactly)."""
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = gguf_tensors(model)
    assert sorted(stored) == sorted(want)
    for name, ours in want.items():
        assert stored[name].shape == ours.shape, (name, stored[name].shape, ours.shape)
        exact = ours.astype(np.float16).astype(np.float32) if outtype == "f16" and ours.ndim == 2 else ours
        np.testing.assert_array_equal(stored[name].astype(np.float32), exact, err_msg=name)
