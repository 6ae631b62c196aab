"""What the Trainer asks of an engine (:class:`Engine`), the optimizer step both engines share, and
:func:`make_engine`, which sets up the process group and builds the engine a config names."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from trainloop.clipping import ClipGroups, ClipReport, adamw_param_groups
from trainloop.config import TrainConfig

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
NamedGrads = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class StepReport:
    """One optimizer step as the engine took it: the clipping (norms before clipping, factors), whether the step was
    skipped (a non-finite loss or gradient norm: gradients dropped, optimizer state untouched) and the fp16 loss
    scale (None without one)."""

    clip: ClipReport
    skipped: bool
    loss_scale: float | None


@runtime_checkable
class Engine(Protocol):
    """What the loop needs of an engine, in the order it asks each step: ``backward`` per micro-batch (gradients
    synchronised only when ``sync``), then one ``clip_and_step``. Implemented by ``TorchEngine`` (plain torch, DDP
    under torchrun), ``DeepSpeedEngine`` (ZeRO stages 0-3) and ``FSDPEngine`` (``fully_shard``); :func:`make_engine`
    builds the one a config names."""

    name: str  # "torch", "deepspeed" or "fsdp": recorded in each checkpoint, checked on resume
    module: torch.nn.Module  # the bare model (no DDP/DeepSpeed wrapper): evaluation, state dicts, FLOPs

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, sync: bool, divisor: float) -> torch.Tensor:
        """Forward and backward of one micro-batch, its mean loss divided by ``divisor`` (:func:`scaled_loss`: the
        loop weighs each micro-batch by its scored targets); gradients synchronised (averaged) across ranks when
        ``sync`` (the last micro-batch of a step). Returns the detached, undivided loss."""
        ...

    def clip_and_step(
        self,
        clip: ClipGroups,
        lr: float,
        *,
        loss_finite: bool,
        inspect: Callable[[NamedGrads], None] | None = None,
    ) -> StepReport:
        """Clip the accumulated gradients per group (norms over the full gradients, however they are partitioned),
        then step at ``lr``, or skip when the ranks' loss (``loss_finite``) or the gradient norm is not finite.
        ``inspect`` receives the full gradients first (a collective on partitioned engines)."""
        ...

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def save(self, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
        """Write this rank's share of the engine state, with ``client_state`` beside it (collective: every rank
        calls it) and the engine's own config files."""
        ...

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        """Restore the engine state written by ``saved_world_size`` ranks (any number: a partitioned engine
        re-partitions it); returns the client state saved with it. Collective."""
        ...


def scaled_loss(loss: torch.Tensor, divisor: float) -> torch.Tensor:
    """``loss / divisor``, what a micro-batch contributes to the step's gradient; an infinite divisor (a micro-batch
    without a scored target, whose mean loss is NaN) contributes zero, yet still runs its backward, since every rank
    must take part in the gradients' all-reduce.

    Example:
        >>> scaled_loss(torch.tensor(3.0), 2.0), scaled_loss(torch.tensor(float("nan")), math.inf)
        (tensor(1.5000), tensor(0.))
    """
    if divisor == 1:
        return loss
    if math.isinf(divisor):
        return torch.nan_to_num(loss, nan=0.0) * 0.0
    return loss / divisor


def micro_batch_divisors(counts: Sequence[int], world_size: int, total: float) -> list[float]:
    """What each micro-batch's mean loss is divided by so that the step's gradient, after the ranks' average, is the
    gradient of the mean loss over every scored target of the step: ``total`` (all ranks' targets) over this
    micro-batch's ``count`` times the ranks. Micro-batches of equal counts on every rank give ``grad_accum``, as a
    plain mean of the micro-batches would.

    Example (two micro-batches, 1 and 99 targets, one rank; and 4 equal ones):
        >>> micro_batch_divisors([1, 99], 1, 100), micro_batch_divisors([8, 8, 8, 8], 2, 64)
        ([100.0, 1.0101010101010102], [4.0, 4.0, 4.0, 4.0])
    """
    return [total / (count * world_size) if count else math.inf for count in counts]


class SteppingEngine:
    """The optimizer step of both engines, written once: set the learning rate, unscale, inspect, clip the local
    gradients per group, hand them back, then step or skip. Each engine supplies the pieces below."""

    config: TrainConfig
    optimizer: torch.optim.Optimizer

    def clip_and_step(
        self,
        clip: ClipGroups,
        lr: float,
        *,
        loss_finite: bool,
        inspect: Callable[[NamedGrads], None] | None = None,
    ) -> StepReport:
        set_lr(self.optimizer, lr)
        scale = self._unscale()
        if inspect is not None:
            inspect(self._full_grads())
        named, partitioned = self._local_grads()
        report = clip.clip(named, all_reduce=partitioned, unscale=scale)
        self._after_clip(named)
        skipped = not (loss_finite and math.isfinite(report.total_norm))
        if skipped:
            self._skip()
        else:
            self._step()
        return StepReport(report, skipped, self._loss_scale())

    # What each engine supplies.
    def _unscale(self) -> float:
        """Remove a loss scale from the gradients where the engine can; returns the scale still present."""
        raise NotImplementedError

    def _local_grads(self) -> tuple[NamedGrads, bool]:
        """(name, gradient) pairs this rank holds, and whether their squared sums need an all-reduce (partitioned)."""
        raise NotImplementedError

    def _after_clip(self, named: NamedGrads) -> None:
        """Hand clipped gradients back where ``_local_grads`` gave copies (a no-op for views)."""

    def _full_grads(self) -> NamedGrads:
        """Full gradients on every rank (a collective on partitioned engines)."""
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _skip(self) -> None:
        """Drop this step's gradients, leaving the optimizer state untouched."""
        raise NotImplementedError

    def _loss_scale(self) -> float | None:
        return None


def trainable_names(module: torch.nn.Module) -> list[str]:
    """The names of the parameters that train, in ``named_parameters`` order (the clipping groups' input)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def make_engine(
    model: torch.nn.Module,
    config: TrainConfig,
    *,
    ds_config: dict[str, Any] | str | Path | None = None,
) -> Engine:
    """The engine ``config.engine`` names, on this rank's device, after setting up the process group (gloo on CPU,
    nccl on CUDA; DeepSpeed's communication layer for ``engine="deepspeed"``, even alone; a one-rank group for
    ``engine="fsdp"`` alone, since ``fully_shard`` needs one).

    ``ds_config`` (``engine="deepspeed"`` only) is a DeepSpeed JSON config (a dict or a file): it is resolved once
    against ``config`` (:func:`trainloop.build_ds_config`) and that dict is what ``deepspeed.initialize`` gets; a
    dict that :func:`trainloop.adopt_ds_config` or ``build_ds_config`` already resolved for ``config`` passes as it is.

    Example:
        >>> import torch
        >>> engine = make_engine(torch.nn.Linear(4, 1), TrainConfig())
        >>> engine.name, isinstance(engine, Engine)
        ('torch', True)
    """
    from trainloop.config import ConfigError
    from trainloop.distributed import setup_distributed

    if ds_config is not None and config.engine != "deepspeed":
        raise ConfigError(f"ds_config given but TrainConfig.engine={config.engine!r}: set engine='deepspeed'")
    _, world_size, device = setup_distributed(config.engine, config.dist_timeout_s)
    if config.engine == "deepspeed":
        from trainloop.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, config, device, ds_config, world_size)
    if config.engine == "fsdp":
        from trainloop.engine_fsdp import FSDPEngine

        return FSDPEngine(model, config, device, world_size)
    from trainloop.engine_torch import TorchEngine

    return TorchEngine(model, config, device)


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


def grads_of(params: Sequence[tuple[str, torch.nn.Parameter]]) -> NamedGrads:
    """(name, .grad) of the parameters that hold one."""
    return [(n, p.grad) for n, p in params if p.grad is not None]
