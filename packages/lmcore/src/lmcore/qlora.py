"""QLoRA (Dettmers et al. 2023): frozen base weights in 4-bit NormalFloat, LoRA adapters on top.

The NF4 format is torchao's (``NF4Tensor``: blocks of 64 weights share an absmax scale, and the scales are
quantized again to int8 in blocks of 256), which runs on the CPU as well as on a GPU: 0.52 bytes per weight.
The layer dequantizes on the fly and multiplies in the input's dtype (the run's: fp32, or bf16 under autocast).

A model's ``state_dict`` holds the dequantized base weights under the plain layer's names, so a QLoRA checkpoint
is read back (eval, generate, export) as a LoRA model computing the same function; loading a state dict into a
quantized model keeps its own NF4 weights (they were quantized from the run's source and do not change).

Under FSDP (``fully_shard``, trainloop's engine "fsdp") each NF4 weight is sharded as it is stored: torchao's
NF4Tensor all-gathers its codes, scales and factors itself, and each rank keeps whole rows of whole int8 scale
blocks (:func:`scaler_block_for` makes every layer's count of them split over 2, 4 or 8 ranks). The state dict then
holds each rank's rows dequantized, as a DTensor, which the checkpoint gathers or writes shard by shard.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lmcore.extras import MissingExtraError, install_hint

NF4_BLOCK = 64  # weights per absmax scale
NF4_SCALER_BLOCK = 256  # scales per int8 block of the double quantization
NF4_SHARDS = 8  # the int8 blocks of a layer number a multiple of this where its size allows (scaler_block_for)
# The widest gap between two neighbouring NF4 codes (-1.0 .. -0.6962; the code is asymmetric, 0.7230 .. 1.0 on
# the positive side): a weight lands at most half of it, times its block's scale, from its code.
NF4_MAX_HALF_GAP = (1.0 - 0.6961928009986877) / 2

M = TypeVar("M", bound=nn.Module)


def require_nf4() -> Any:
    """torchao's NF4 module, or a MissingExtraError naming the extra to install."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as exc:
        raise MissingExtraError(
            f"QLoRA needs torchao (NF4 weights), which is not importable here ({exc}): "
            f"{install_hint('qlora', 'lmtrain')} (or {install_hint('qlora')} for lmcore alone)"
        ) from None
    return nf4_tensor


def scaler_block_for(numel: int, block_size: int = NF4_BLOCK, shards: int = NF4_SHARDS) -> int:
    """The scales per int8 block: the largest count up to NF4_SCALER_BLOCK that divides the layer's number of blocks
    (torchao needs whole blocks) into a multiple of ``shards`` int8 blocks, or of the largest power of two below
    ``shards`` that the layer allows. The format does not depend on the number of ranks a run has, and FSDP's
    ``fully_shard`` can split each layer into whole int8 blocks over 2, 4 or 8 ranks (where its rows split evenly).

    Example:
        >>> scaler_block_for(1024 * 256), scaler_block_for(64 * 64), scaler_block_for(64 * 96)
        (256, 8, 12)
    """
    blocks = numel // block_size
    multiple = shards
    while multiple > 1:
        fits = [s for s in range(min(NF4_SCALER_BLOCK, blocks // multiple), 0, -1) if blocks % (s * multiple) == 0]
        if fits:
            return fits[0]
        multiple //= 2
    return next(s for s in range(min(NF4_SCALER_BLOCK, blocks), 0, -1) if blocks % s == 0)


def nf4_local(weight: Tensor) -> Any:
    """The NF4Tensor this process holds: ``weight`` itself, or its local shard where FSDP made it a DTensor.

    Example (needs torchao):
        >>> layer = NF4Linear(nn.Linear(64, 64))
        >>> nf4_local(layer.weight) is layer.weight, tuple(nf4_local(layer.weight).quantized_data.shape)
        (True, (2048,))
    """
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored in NF4 (see the module docstring); the bias stays as it was."""

    def __init__(self, linear: nn.Linear, block_size: int = NF4_BLOCK, scaler_block_size: int | None = None):
        super().__init__()
        nf4 = require_nf4()
        if scaler_block_size is None:
            scaler_block_size = scaler_block_for(linear.weight.numel(), block_size)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = nf4.to_nf4(linear.weight.detach(), block_size, scaler_block_size)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._linear_nf4 = nf4.linear_nf4

    def forward(self, x: Tensor) -> Tensor:
        y = self._linear_nf4(x, self.weight)  # (..., in) -> (..., out), dequantized on the fly
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The weight the layer computes with, as a plain tensor (out, in); under FSDP (a DTensor of NF4 shards),
        a DTensor of the same layout holding this rank's rows dequantized."""
        weight: Any = self.weight  # torchao's NF4Tensor, or a DTensor whose local shard is one
        local = nf4_local(weight)
        if local is weight:
            return local.get_original_weight()
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.get_original_weight(), weight.device_mesh, weight.placements,
                                  shape=weight.shape, stride=weight.stride())  # fmt: skip

    def quantized_bytes(self) -> int:
        """Bytes of the NF4 weight this process holds (its shard, under FSDP): codes, int8 scales, their factors."""
        weight: Any = nf4_local(self.weight)  # torchao's NF4Tensor: its inner tensors are what it stores
        inner, _ = weight.__tensor_flatten__()
        return sum(getattr(weight, name).numel() * getattr(weight, name).element_size() for name in inner)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.dequantized().detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
        state_dict.pop(prefix + "weight", None)  # the NF4 weight stays (module docstring)
        if self.bias is not None and prefix + "bias" in state_dict:
            with torch.no_grad():
                self.bias.copy_(state_dict.pop(prefix + "bias"))
        elif self.bias is not None and strict:
            missing_keys.append(prefix + "bias")


def quantize_frozen_linears(model: M, skip: tuple[str, ...] = ("lm_head",)) -> M:
    """Replace every frozen nn.Linear of ``model`` (the bases of LoRA adapters and the untouched layers) by an
    :class:`NF4Linear`, in place; layers named in ``skip`` (the output head, tied to the embedding) stay. Returns
    ``model``.

    Example (needs torchao):
        >>> from lmcore import GPT, ModelConfig, apply_lora
        >>> model = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4)
        >>> model = quantize_frozen_linears(model)
        >>> type(model.layers[0].self_attn.q_proj.base).__name__, type(model.layers[0].mlp.up_proj).__name__
        ('NF4Linear', 'NF4Linear')
    """
    found = [
        (parent, attr, child)
        for parent in model.modules()
        for attr, child in parent.named_children()
        if type(child) is nn.Linear
        and not child.weight.requires_grad
        and attr not in skip
        and child.weight.numel() % NF4_BLOCK == 0  # whole blocks of 64 (every width a multiple of 64 qualifies)
    ]
    found.reverse()
    while found:  # one layer at a time: each fp32 weight is freed as soon as its NF4 copy replaces it
        parent, attr, child = found.pop()
        setattr(parent, attr, NF4Linear(child))
        del child
    # lmcore.from_hf's tensors are views of the mapped safetensors file: the pages of the weights just replaced stay
    # resident for as long as any other tensor of that file (the embedding, norms, biases) keeps the mapping. Those
    # get memory of their own, and the mapping goes with its last view.
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.requires_grad and type(tensor.data) is torch.Tensor:
                tensor.data = tensor.data.clone()
    return model


def base_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the linear layers' frozen weights as stored ("stored") and as they would be in bf16 ("bf16")."""
    stored = bf16 = 0
    for name, module in model.named_modules():
        if name.endswith("lm_head"):  # the output head: tied to the embedding, which stays as it is
            continue
        if isinstance(module, NF4Linear):
            stored += module.quantized_bytes()
            bf16 += 2 * module.in_features * module.out_features
        elif type(module) is nn.Linear and not module.weight.requires_grad:
            stored += module.weight.numel() * module.weight.element_size()
            bf16 += 2 * module.weight.numel()
    return {"stored": stored, "bf16": bf16}
