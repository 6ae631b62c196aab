"""What the Trainer asks of an engine (:class:`Engine`), and the optimizer setup both engines share."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch

from trainloop.clipping import adamw_param_groups
from trainloop.config import TrainConfig

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine(Protocol):
    """One optimizer step is ``micro_step`` x grad_accum, ``unscale``, per-group clipping of ``local_grads``,
    ``after_clip``, then ``step`` (or ``skip`` for a non-finite step). Implemented by ``TorchEngine`` (plain torch,
    DDP under torchrun) and ``DeepSpeedEngine`` (ZeRO stages 0-3)."""

    name: str  # "torch" or "deepspeed": recorded in each checkpoint, checked on resume
    module: torch.nn.Module  # the bare model (no DDP/DeepSpeed wrapper): evaluation, state dicts
    optimizer: torch.optim.Optimizer  # its param_groups' "lr" is set before every step
    names: list[str]  # trainable parameter names, in the order local_grads uses

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients synchronised on the last); the detached loss."""
        ...

    def unscale(self) -> float:
        """Remove a loss scale from the gradients where the engine can; returns the scale still present."""
        ...

    def local_grads(self) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """(name, gradient) pairs this rank holds, and whether their squared sums need an all-reduce (partitioned)."""
        ...

    def after_clip(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Hand clipped gradients back where ``local_grads`` gave copies (a no-op for views)."""
        ...

    def full_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Full gradients on every rank (a collective on partitioned engines)."""
        ...

    def step(self) -> None: ...

    def skip(self) -> None:
        """Drop this step's gradients, leaving the optimizer state untouched."""
        ...

    def loss_scale(self) -> float | None:
        """The fp16 loss scale, None without one."""
        ...

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights under the module's state_dict keys (a collective on partitioned engines)."""
        ...

    def save(self, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
        """Write this rank's share of the engine state (collective: every rank calls it)."""
        ...

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        """Restore the engine state written by ``saved_world_size`` ranks (any number: a partitioned engine
        re-partitions it); returns the client state saved with it. Collective."""
        ...

    def config_files(self) -> dict[str, Any]:
        """JSON documents to keep beside the checkpoint (file name -> content), e.g. the DeepSpeed config."""
        ...


def make_adamw(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the model's parameters, decay on matrices only (:func:`adamw_param_groups`), the config's betas
    and eps; the fused implementation where torch has one for the parameters' device.

    Under ZeRO-Offload (``offload_optimizer``) it steps on the host, on each rank's fp32 partition: there
    benchmarks/bench_optimizer.py measured the fused AdamW at 0.70x-1.12x the step time of DeepSpeed's CPU Adam
    (median 0.975x; figures in the README), so it is kept, and no ``cpu_adam`` extension is JIT-built."""
    params = adamw_param_groups(model, config.weight_decay)
    devices = {p.device.type for group in params for p in group["params"]}
    # The fused kernel updates each tensor in one pass (benchmarks/bench_optimizer.py compares the implementations).
    fused = devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(params, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=fused)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = AUTOCAST_DTYPES[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
