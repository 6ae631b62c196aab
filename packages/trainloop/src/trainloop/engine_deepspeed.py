"""The DeepSpeed engine: ZeRO stages 0-3 with the loop's own AdamW, schedule and per-group clipping.

Per-group norms under ZeRO-1/2: after the boundary backward, each rank holds the averaged gradient *fragments* of
the parameters in its optimizer partition (``param._hp_mapping``). Every element is owned by exactly one rank, so
per-group squared sums of the local fragments, all-reduced, give the exact global norms; the clip factor is then
applied to those fragments in place, before ``engine.step()`` hands them to the optimizer. ZeRO-3 does the same with
``safe_get_local_grad``/``safe_set_local_grad``; stage 0 in fp32 keeps full averaged ``p.grad`` on every rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainloop.checkpoint import CheckpointError, write_weights
from trainloop.config import TrainConfig
from trainloop.distributed import barrier
from trainloop.ds_config import build_ds_config
from trainloop.engine import make_adamw
from trainloop.engine_torch import loss_of
from trainloop.extras import import_extra

DS_SUBDIR = "deepspeed"
DS_TAG = "state"


def to_universal(tag_dir: Path, out_tag_dir: Path) -> None:
    """Convert one ZeRO-1/2 checkpoint tag into DeepSpeed's universal checkpoint (any world size loads it)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    if out_tag_dir.exists():
        shutil.rmtree(out_tag_dir)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(out_tag_dir),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines would interleave with the run's log
        ds_to_universal(args)


def _local_fragment(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the reduced gradient of a ZeRO-1/2 parameter (a view: scaling it scales the grad)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    frag = mapping.get_lp_grad_fragment(param._index_in_param_group)
    addr = mapping.lp_fragment_address
    flat = frag.view(-1)
    # The bf16 optimizer keeps a full-size accumulation buffer; only the owned slice counts (as in DeepSpeed's own
    # get_full_hp_grad), otherwise every rank would add the whole gradient.
    if flat.numel() == param.numel() and addr.numel != param.numel():
        flat = flat.narrow(0, addr.start, addr.numel)
    return flat


class DeepSpeedEngine:
    """``deepspeed.initialize`` with the reconciled config; implements :class:`trainloop.engine.Engine`."""

    name = "deepspeed"

    def __init__(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device, ds_config: Any, world_size: int
    ) -> None:
        deepspeed = import_extra("deepspeed", "deepspeed", "TrainConfig.engine='deepspeed'")

        self.config = config
        self.device = device
        self.world_size = world_size
        self.ds_config, self.notes = build_ds_config(ds_config, config, world_size, on_cpu=device.type == "cpu")
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_adamw(model, config), config=self.ds_config
        )
        self.module = self.engine.module
        self.stage = int(self.ds_config["zero_optimization"]["stage"])
        self._params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self._params]

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool, n_micro: int) -> torch.Tensor:
        # engine.backward divides by gradient_accumulation_steps itself.
        loss = loss_of(self.engine(inputs, targets))
        self.engine.backward(loss)
        if not is_last:
            self.engine.step()  # only advances DeepSpeed's micro-step counter off the boundary
        return loss.detach().float()

    def unscale(self) -> float:
        scale = getattr(self.optimizer, "loss_scale", None) if self.config.precision == "fp16" else None
        return float(scale) if scale else 1.0

    def local_grads(self) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            self._z3 = [(n, p, safe_get_local_grad(p)) for n, p in self._params]
            return [(n, g) for n, _, g in self._z3 if g is not None], True
        out, partitioned = [], False
        for n, p in self._params:
            if hasattr(p, "_hp_mapping"):
                partitioned = True
                frag = _local_fragment(p)
                if frag is not None:
                    out.append((n, frag))
            elif p.grad is not None:
                out.append((n, p.grad))
        return out, partitioned

    def after_clip(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """ZeRO-3 hands out copies of the local gradient: write the clipped ones back (ZeRO-1/2 gave views)."""
        if self.stage == 3:
            from deepspeed.utils import safe_set_local_grad

            clipped = dict(named)
            for n, p, _ in self._z3:
                if n in clipped:
                    safe_set_local_grad(p, clipped[n])

    def full_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Full gradients on every rank (a collective: all ranks must call it)."""
        from deepspeed.utils import safe_get_full_grad

        return [(n, g) for n, p in self._params if (g := safe_get_full_grad(p)) is not None]

    def step(self) -> None:
        self.engine.step()

    def skip(self) -> None:
        """Skip the boundary step with the optimizer untouched, through DeepSpeed's own overflow path."""
        opt = self.optimizer
        if self.stage in (1, 2) and hasattr(opt, "check_overflow"):
            saved = opt.check_grad_overflow
            opt.check_grad_overflow = True
            opt.check_overflow = lambda partition_gradients=True: setattr(opt, "overflow", True)
            try:
                self.engine.step()
            finally:
                del opt.check_overflow
                opt.check_grad_overflow = saved
        elif self.stage == 3:
            # ZeRO-3 treats a non-finite gradient norm as an overflow and skips.
            from deepspeed.utils import safe_set_local_grad

            for _, p in self._params:
                safe_set_local_grad(p, torch.full_like(p.ds_tensor, float("nan"), dtype=torch.float32))
            self.engine.step()
        else:
            for _, p in self._params:
                p.grad = None
            self.engine.step()

    def loss_scale(self) -> float | None:
        return self.unscale() if self.config.precision == "fp16" else None

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_of(self.engine(inputs, targets))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict keys (tied weights under each name, persistent buffers only) with fp32 master
        weights gathered on every rank (a collective: same order everywhere)."""
        from deepspeed.utils import safe_get_full_fp32_param

        gathered: dict[int, torch.Tensor] = {}
        state = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.nn.Parameter):
                if id(t) not in gathered:
                    full = safe_get_full_fp32_param(t)
                    gathered[id(t)] = (full if full is not None else t.detach()).float().cpu()
                state[name] = gathered[id(t)]
            else:
                state[name] = t.detach().cpu()
        return state

    def save(self, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
        # Every rank calls both: save_checkpoint writes each rank's optimizer shard, the gather is a collective.
        self.engine.save_checkpoint(str(ckpt_dir / DS_SUBDIR), tag=DS_TAG, client_state=client_state)
        state = self.full_state_dict()
        if rank == 0:
            write_weights(self.module, state, ckpt_dir)

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        """DeepSpeed's own checkpoint; written by another number of ranks, it is first converted to DeepSpeed's
        universal format (rank 0, next to the checkpoint, deleted after loading), which re-partitions the optimizer
        state for this world size."""
        if saved_world_size == self.world_size:
            return self._load(ckpt_dir / DS_SUBDIR, DS_TAG)
        universal = ckpt_dir.parent / f".universal-{ckpt_dir.name}"
        if dist.get_rank() == 0:
            to_universal(ckpt_dir / DS_SUBDIR / DS_TAG, universal / DS_TAG)
        barrier()
        self.engine._config.load_universal_checkpoint = True  # read by load_checkpoint; set at init otherwise
        try:
            state = self._load(universal, DS_TAG)
        finally:
            self.engine._config.load_universal_checkpoint = False
            barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(universal, ignore_errors=True)
        return state

    def _load(self, load_dir: Path, tag: str) -> dict[str, Any]:
        path, client_state = self.engine.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise CheckpointError(f"{load_dir / tag}: DeepSpeed found no checkpoint to load")
        return dict(client_state or {})

    def config_files(self) -> dict[str, Any]:
        return {"ds_config.json": self.ds_config}
