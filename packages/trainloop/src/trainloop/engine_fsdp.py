"""The FSDP engine: PyTorch's ``fully_shard`` (FSDP2) on each block and on the root, with the loop's own AdamW,
schedule and per-group clipping, and checkpoints through ``torch.distributed.checkpoint``.

Every parameter becomes a DTensor sharded on dim 0 over the ranks, and so do its gradient and AdamW's state: each
element of a gradient lives on exactly one rank, so per-group squared sums of the local shards, all-reduced, give
the exact norms of the full gradients, and the clip factor scales the local shards in place before the step.

A parameter whose tensor type brings its own all-gather (FSDP2's extension: torchao's NF4 weights of QLoRA) is
sharded as that type stores it, each rank holding whole rows of it; a number of ranks that cannot split it into equal
shards is refused before anything trains (:func:`check_even_shards`).

Checkpoints (:mod:`trainloop.fsdp_checkpoint`) are either one shard file per rank under ``dcp/`` (the default:
any number of ranks loads them, the shards re-split as they load) or, with ``fsdp_checkpoint="full"``, the whole
state gathered on rank 0 and broadcast from it on load. Both write the consolidated fp32 weights that evaluation,
generation and export read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from trainloop.config import ConfigError, TrainConfig
from trainloop.engine import NamedGrads, SteppingEngine, make_adamw, scaled_loss
from trainloop.engine_torch import loss_of


def shard_units(model: nn.Module, class_names: Sequence[str] | None = None) -> list[nn.Module]:
    """The modules that each get their own ``fully_shard`` (their parameters gathered together, one unit at a
    time), innermost first: modules of the classes ``class_names`` names; else what ``model.shard_units()``
    returns; else the blocks of the model's largest ``nn.ModuleList`` whose members share one class (a
    transformer's layers). A model where none of these finds a module is refused (ConfigError).

    Example:
        >>> blocks = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
        >>> [type(m).__name__ for m in shard_units(blocks)]
        ['Linear', 'Linear', 'Linear']
    """
    where = type(model).__name__
    if class_names is not None:
        present = {type(m).__name__ for m in model.modules()}
        absent = sorted(set(class_names) - present)
        if absent:
            raise ConfigError(
                f"TrainConfig.fsdp_units={list(class_names)!r}: {where} has no module of class {absent}; "
                f"its module classes are {sorted(present)[:12]}"
            )
        units = [m for m in model.modules() if m is not model and type(m).__name__ in class_names]
    elif callable(hook := getattr(model, "shard_units", None)):
        units = list(hook())
        if not all(isinstance(m, nn.Module) for m in units):
            raise ConfigError(f"{where}.shard_units() must return nn.Module objects")
    else:
        best: list[nn.Module] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1:
                size = sum(p.numel() for p in m.parameters())
                if size > sum(p.numel() for b in best for p in b.parameters()):
                    best = list(m)
        units = best
    if not units:
        raise ConfigError(
            f"TrainConfig.engine='fsdp': {where} has no blocks to shard (no shard_units() method and no "
            "nn.ModuleList of modules of one class); set TrainConfig.fsdp_units to the class names of its blocks, "
            "or train it with engine='torch'"
        )
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: -depth.get(id(m), 0))  # inner units first: fully_shard goes bottom-up


def check_even_shards(model: nn.Module, world_size: int) -> list[nn.Parameter]:
    """The parameters whose tensor type brings its own all-gather (FSDP2's ``fsdp_pre_all_gather`` extension, such as
    torchao's NF4 weights of QLoRA), each checked to split into ``world_size`` equal row blocks: FSDP pads an uneven
    last shard, which such a format cannot hold (an NF4 shard is whole rows of whole int8 scale blocks). One that does
    not split is refused (ConfigError naming it and the fix).

    Example:
        >>> check_even_shards(nn.Linear(4, 4), 2)  # plain tensors: FSDP shards any of them
        []
    """
    found = [(n, p) for n, p in model.named_parameters() if hasattr(p, "fsdp_pre_all_gather")]
    for name, param in found:
        kind, shape = type(param).__name__, tuple(param.shape)
        why = "no rows" if not shape else f"{shape[0]} rows" if shape[0] % world_size else ""
        if not why:
            try:
                shards = torch.chunk(param.detach(), world_size, dim=0)
                if len(shards) != world_size or any(tuple(s.shape) != shards[0].shape for s in shards):
                    why = "unequal shards"
            except (AssertionError, NotImplementedError, RuntimeError) as exc:  # the format's own refusal
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if why:
            raise ConfigError(
                f"TrainConfig.engine='fsdp' on {world_size} ranks: {name} ({kind}, shape {shape}) does not split "
                f"into {world_size} equal shards ({why}); run on a number of ranks that divides it (2, 4 or 8 for "
                "lmcore's NF4 weights), or use engine='torch'"
            )
    return [p for _, p in found]


class FSDPEngine(SteppingEngine):
    """``fully_shard`` with bf16 compute and fp32 gradient reduction for ``precision="bf16"`` (fp32 everywhere for
    "fp32"), optionally ``CPUOffloadPolicy``; gradients reduce-scattered only on the micro-batch that steps.
    Implements :class:`trainloop.engine.Engine`."""

    name = "fsdp"

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if config.fsdp_cpu_offload and device.type != "cuda":
            raise ConfigError(
                "TrainConfig.fsdp_cpu_offload=True on a run without a GPU: the parameters already live in host "
                "memory, there is nothing to offload; drop fsdp_cpu_offload"
            )
        self.config = config
        self.device = device
        self.world_size = world_size
        units = shard_units(model, config.fsdp_units)
        extended = check_even_shards(model, world_size)
        # On one rank torch 2.13's fully_shard takes a shortcut that copies only the first of the tensors an extension
        # all-gathers (NF4: codes, scales, factors), so frozen ones stay out of it: one rank has nothing to shard.
        ignored = {p for p in extended if not p.requires_grad} if world_size == 1 else set()
        if not config.fsdp_cpu_offload:
            model.to(device)  # offloaded shards stay on the host; fully_shard moves the rest to the mesh's device
        mesh = init_device_mesh(device.type, (world_size,))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if config.fsdp_cpu_offload else OffloadPolicy()
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
        self.module = model
        self.n_units = len(units)
        self.optimizer = make_adamw(model, config)
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    # A forward all-gathers each unit's parameters: every rank must run the same number of them.
    collective_forward = True

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, sync: bool, divisor: float) -> torch.Tensor:
        """Forward and backward of one micro-batch; the gradients are reduce-scattered only when ``sync`` (before
        that each rank accumulates its own unsharded gradients), or on every micro-batch with
        ``fsdp_sync_every_micro``."""
        self.module.set_requires_gradient_sync(sync or self.config.fsdp_sync_every_micro)  # type: ignore[operator]
        loss = loss_of(self.module(inputs, targets))
        scaled_loss(loss, divisor).backward()
        return loss.detach().float()

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_of(self.module(inputs, targets)).float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict keys with full fp32 tensors on rank 0 (empty elsewhere); a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast("dict[str, torch.Tensor]", get_model_state_dict(self.module, options=options))

    def save(self, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
        from trainloop.fsdp_checkpoint import save_fsdp

        save_fsdp(self, ckpt_dir, client_state, rank)

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        """Either kind of FSDP checkpoint, whichever the directory holds, written by any number of ranks."""
        from trainloop.fsdp_checkpoint import load_fsdp

        return load_fsdp(self, ckpt_dir)

    # The pieces of SteppingEngine.clip_and_step.
    def _unscale(self) -> float:
        return 1.0  # no loss scale: fp16 is refused for this engine (TrainConfig)

    def _local_grads(self) -> tuple[NamedGrads, bool]:
        from torch.distributed.tensor import DTensor

        out: NamedGrads = []
        for n, p in self._params:
            g = p.grad
            if g is not None:
                out.append((n, g.to_local() if isinstance(g, DTensor) else g))  # a view: clipping writes through
        return out, True

    def _full_grads(self) -> NamedGrads:
        """Full gradients on every rank (a collective: all ranks must call it)."""
        from torch.distributed.tensor import DTensor

        grads = [(n, p.grad) for n, p in self._params if p.grad is not None]
        return [(n, g.full_tensor() if isinstance(g, DTensor) else g) for n, g in grads]

    def _step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _skip(self) -> None:
        """AdamW skips parameters without a gradient, so dropping them leaves its state untouched."""
        self.optimizer.zero_grad(set_to_none=True)
