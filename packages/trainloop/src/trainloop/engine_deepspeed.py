"""The DeepSpeed engine: ZeRO stages 0-3 with the loop's own AdamW, schedule and per-group clipping.

Per-group norms under ZeRO-1/2: after the boundary backward, each rank holds the averaged gradient *fragments* of
the parameters in its optimizer partition. Every element is owned by exactly one rank, so per-group squared sums of
the local fragments, all-reduced, give the exact global norms; the clip factor is then applied to those fragments
in place, before ``engine.step()`` hands them to the optimizer. ZeRO-3 does the same with
``safe_get_local_grad``/``safe_set_local_grad``; stage 0 in fp32 keeps full averaged ``p.grad`` on every rank.
What this needs of DeepSpeed beyond its public API is in :mod:`trainloop.deepspeed_compat`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainloop import deepspeed_compat as compat
from trainloop.checkpoint import CheckpointError, write_weights
from trainloop.config import ConfigError, TrainConfig
from trainloop.distributed import barrier, broadcast_json
from trainloop.ds_config import ResolvedDSConfig, build_ds_config
from trainloop.engine import NamedGrads, SteppingEngine, make_adamw, scaled_loss
from trainloop.engine_torch import loss_of
from trainloop.extras import import_extra

# The start of DeepSpeed 0.19.8's assertion when parameters on NVMe outnumber the swap buffers
# (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py, swap_in).
SWAP_BUFFERS_ASSERTION = "Not enough buffers"
DS_SUBDIR = "deepspeed"
DS_TAG = "state"


class DeepSpeedEngine(SteppingEngine):
    """``deepspeed.initialize`` with the config resolved once (a :class:`~trainloop.ds_config.ResolvedDSConfig`
    passes as it is; a JSON file or a raw dict is resolved here); implements :class:`trainloop.engine.Engine`."""

    name = "deepspeed"

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainConfig,
        device: torch.device,
        ds_config: ResolvedDSConfig | dict[str, Any] | str | Path | None,
        world_size: int,
    ) -> None:
        deepspeed = import_extra("deepspeed", "deepspeed", "TrainConfig.engine='deepspeed'")
        compat.check_version(deepspeed.__version__)

        self.config = config
        self.device = device
        self.world_size = world_size
        if not isinstance(ds_config, ResolvedDSConfig):
            ds_config = ResolvedDSConfig(*build_ds_config(ds_config, config, world_size, on_cpu=device.type == "cpu"))
        self.ds_config, self.notes = ds_config.config, list(ds_config.notes)
        with compat.keeping_model_dtype():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=make_adamw(model, config), config=self.ds_config
            )
        compat.load_safely(self.engine)  # its checkpoint files are read without unpickling code
        self.module = self.engine.module
        self.stage = int(self.ds_config["zero_optimization"]["stage"])
        self._params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self._params]
        # ZeRO-3 with the optimizer states on NVMe takes the clipped gradients inside its step (compat says why).
        swapped = self.stage == 3 and compat.swaps_optimizer(self.optimizer)
        self._swapped = compat.SwappedGradients(self.optimizer) if swapped else None

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, sync: bool, divisor: float) -> torch.Tensor:
        # engine.backward divides by gradient_accumulation_steps itself (the divisor of equal micro-batches), and
        # DeepSpeed reduces the gradients at its own accumulation boundary, which ``sync`` marks.
        with self._swap_buffers_named():
            loss = loss_of(self.engine(inputs, targets))
            accum = self.config.grad_accum
            self.engine.backward(loss if divisor == accum else scaled_loss(loss, divisor / accum))
            if not sync:
                self.engine.step()  # only advances DeepSpeed's micro-step counter off the boundary
        return loss.detach().float()

    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._swap_buffers_named():
            return loss_of(self.engine(inputs, targets))

    @contextlib.contextmanager
    def _swap_buffers_named(self) -> Iterator[None]:
        """DeepSpeed's bare "Not enough buffers 0 for swapping 1" (parameters on NVMe: more partitions in flight than
        ``offload_param.buffer_count``) as one line naming the field and the fix."""
        try:
            yield
        except AssertionError as exc:
            if not str(exc).startswith(SWAP_BUFFERS_ASSERTION):
                raise
            settings = self.ds_config["zero_optimization"].get("offload_param") or {}
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_count={settings.get('buffer_count', 5)} is too few: the "
                f"parameters a step gathers from NVMe need more swap buffers at once (DeepSpeed: {exc}); raise "
                f"buffer_count (each buffer pins buffer_size={settings.get('buffer_size', 10**8)} elements of host "
                "memory per rank), e.g. to 16"
            ) from exc

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
            (ckpt_dir / "ds_config.json").write_text(json.dumps(self.ds_config, indent=1))

    def load(self, ckpt_dir: Path, saved_world_size: int) -> dict[str, Any]:
        """DeepSpeed's own checkpoint; written by another number of ranks, it is first converted to DeepSpeed's
        universal format (rank 0, next to the checkpoint, deleted after loading), which re-partitions the optimizer
        state for this world size."""
        if saved_world_size == self.world_size:
            return self._load(ckpt_dir / DS_SUBDIR, DS_TAG)
        if self._swapped is not None:
            raise CheckpointError(
                f"{ckpt_dir}: written by {saved_world_size} rank(s) with offload_optimizer on NVMe, resumed on "
                f"{self.world_size}: DeepSpeed keeps those optimizer states in per-rank swap files, which its "
                f"universal checkpoint cannot re-partition; resume on {saved_world_size} rank(s)"
            )
        universal = ckpt_dir.parent / f".universal-{ckpt_dir.name}"
        refused = None
        if dist.get_rank() == 0:
            try:
                compat.check_checkpoint_files(ckpt_dir / DS_SUBDIR / DS_TAG)  # the converter unpickles what it reads
            except CheckpointError as exc:
                refused = str(exc)
            else:
                compat.to_universal(ckpt_dir / DS_SUBDIR / DS_TAG, universal / DS_TAG)
        refused = broadcast_json(refused)  # every rank refuses with rank 0, none waits for it at a barrier
        if refused is not None:
            raise CheckpointError(refused)
        barrier()
        try:
            with compat.loading_universal(self.engine):
                state = self._load(universal, DS_TAG)
        finally:
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
        if self._swapped is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            compat.restore_swapped_optimizer(
                self.optimizer, load_dir / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            )
        return dict(client_state or {})

    # The pieces of SteppingEngine.clip_and_step.
    def _unscale(self) -> float:
        scale = getattr(self.optimizer, "loss_scale", None) if self.config.precision == "fp16" else None
        return float(scale) if scale else 1.0

    def _local_grads(self) -> tuple[NamedGrads, bool]:
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            self._z3 = [(n, p, safe_get_local_grad(p)) for n, p in self._params]
            if self._swapped is not None:  # views of a swap buffer that the step refills: keep copies
                self._z3 = [(n, p, None if g is None else g.clone()) for n, p, g in self._z3]
            return [(n, g) for n, _, g in self._z3 if g is not None], True
        out: NamedGrads = []
        partitioned = False
        for n, p in self._params:
            if compat.has_zero_mapping(p):
                partitioned = True
                frag = compat.local_fragment(p)
                if frag is not None:
                    out.append((n, frag))
            elif p.grad is not None:
                out.append((n, p.grad))
        return out, partitioned

    def _after_clip(self, named: NamedGrads) -> None:
        """ZeRO-3 hands out copies of the local gradient: write the clipped ones back (ZeRO-1/2 gave views)."""
        if self.stage == 3:
            from deepspeed.utils import safe_set_local_grad

            clipped = dict(named)
            if self._swapped is not None:
                self._swapped.put([(p, clipped[n]) for n, p, _ in self._z3 if n in clipped])
                return
            for n, p, _ in self._z3:
                if n in clipped:
                    safe_set_local_grad(p, clipped[n])

    def _full_grads(self) -> NamedGrads:
        """Full gradients on every rank (a collective: all ranks must call it)."""
        from deepspeed.utils import safe_get_full_grad

        return [(n, g) for n, p in self._params if (g := safe_get_full_grad(p)) is not None]

    def _step(self) -> None:
        self.engine.step()
        if self._swapped is not None:
            self._swapped.put([])

    def _skip(self) -> None:
        """Skip the boundary step with the optimizer untouched, through DeepSpeed's own overflow path."""
        if self.stage in (1, 2) and hasattr(self.optimizer, "check_overflow"):
            compat.skip_zero12_step(self.engine, self.optimizer)
        elif self.stage == 3:
            if self._swapped is not None:
                self._swapped.put([])
            compat.skip_zero3_step(self.engine, self._params)
        else:
            for _, p in self._params:
                p.grad = None
            self.engine.step()

    def _loss_scale(self) -> float | None:
        return self._unscale() if self.config.precision == "fp16" else None
