"""The plain-torch engine: one process, or DDP under torchrun (no gradient all-reduce on inner accumulation steps)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainloop.checkpoint import load_torch, read_weights, save_torch, write_weights
from trainloop.config import TrainConfig
from trainloop.engine import NamedGrads, SteppingEngine, autocast, grads_of, make_adamw, scaled_loss


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a model output: a Tensor, an object with ``.loss`` or a dict with ``"loss"``."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif hasattr(output, "loss"):
        loss = output.loss
    else:
        raise TypeError(
            f"model(inputs, targets) returned {type(output).__name__}; expected a loss Tensor, an object with .loss "
            "or a dict with 'loss'"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"the model's loss must be a scalar Tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}"
        )
    return loss


class TorchEngine(SteppingEngine):
    """AdamW on the model's own parameters; DDP when a process group with more than one rank exists.

    Implements :class:`trainloop.engine.Engine`."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, config: TrainConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.module = model.to(device)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.ddp = (
            DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            if self.distributed
            else None
        )
        self.model: torch.nn.Module = self.ddp if self.ddp is not None else model
        self.optimizer = make_adamw(model, config)
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=config.scaler_init_scale,
            growth_factor=config.scaler_growth_factor,
            backoff_factor=config.scaler_backoff_factor,
            growth_interval=config.scaler_growth_interval,
            enabled=config.precision == "fp16",
        )
        self._params = [p for p in model.named_parameters() if p[1].requires_grad]

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, sync: bool, divisor: float) -> torch.Tensor:
        """Forward and backward of one micro-batch; DDP all-reduces the gradients only when ``sync``."""
        no_sync = self.ddp.no_sync() if (self.ddp is not None and not sync) else contextlib.nullcontext()
        with no_sync:
            with autocast(self.device, self.config.precision):
                loss = loss_of(self.model(inputs, targets))
            self.scaler.scale(scaled_loss(loss, divisor)).backward()
        return loss.detach()

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.config.precision):
            return loss_of(self.module(inputs, targets))

    def save(self, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
        if rank == 0:
            write_weights(self.module, self.module.state_dict(), ckpt_dir)
            state = {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), **client_state}
            save_torch(state, ckpt_dir / "trainer.pt")

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        # Weights and optimizer state are whole (DDP keeps full replicas): any world size loads them.
        read_weights(self.module, ckpt_dir, self.device)
        state = load_torch(ckpt_dir / "trainer.pt", self.device)
        self.optimizer.load_state_dict(state.pop("optimizer"))
        self.scaler.load_state_dict(state.pop("scaler"))
        return state

    # The pieces of SteppingEngine.clip_and_step.
    def _unscale(self) -> float:
        """Remove the loss scale from the gradients; the scale still present is always 1 here."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        return 1.0

    def _local_grads(self) -> tuple[NamedGrads, bool]:
        # DDP already averaged full gradients: no all-reduce of the squared sums.
        return grads_of(self._params), False

    def _full_grads(self) -> NamedGrads:
        return grads_of(self._params)

    def _step(self) -> None:
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _skip(self) -> None:
        """AdamW skips parameters without a gradient, so dropping them leaves its state untouched."""
        if self.scaler.is_enabled():
            self.scaler.update()  # backs the scale off after the inf/NaN found by unscale_
        self.optimizer.zero_grad(set_to_none=True)

    def _loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else None
