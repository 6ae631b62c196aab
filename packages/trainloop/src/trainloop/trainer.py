"""Trainer: one visible loop over micro-batches, for the torch and DeepSpeed engines."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainloop.checkpoint import (
    begin_checkpoint,
    find_resumable,
    finish_checkpoint,
    load_torch,
    prune_checkpoints,
    rng_state,
    save_torch,
    set_rng_state,
    step_dir_name,
)
from trainloop.clipping import ClipGroups
from trainloop.config import TrainConfig
from trainloop.distributed import all_reduce_sum, barrier, setup_distributed
from trainloop.engine_torch import TorchEngine
from trainloop.evaluation import evaluate
from trainloop.faults import NonFiniteLossError, StopSignals, collective_failure
from trainloop.metrics_logging import (
    MetricsLogger,
    add_throughput,
    detect_peak_tflops,
    flops_per_token,
    format_line,
)
from trainloop.schedules import lr_at

Batch = tuple[torch.Tensor, torch.Tensor]


class Trainer:
    """Trains any ``nn.Module`` whose ``model(inputs, targets)`` returns a loss (Tensor, ``.loss`` or ``["loss"]``).

    ``train_data`` yields (inputs, targets) micro-batches; with ``state_dict``/``load_state_dict`` its position is
    checkpointed. ``eval_data`` is a zero-argument callable returning an iterable of batches. ``extra_state``
    (JSON-able) goes into every checkpoint.

    Example:
        >>> cfg = TrainConfig(max_steps=100, lr=1e-3, warmup_steps=10, log_every=10, save_every=50)
        >>> summary = Trainer(model, cfg, batches, run_dir="runs/demo", eval_data=lambda: val_batches).fit()
        >>> summary["step"], summary["checkpoint"]  # doctest: +SKIP
        (100, 'runs/demo/checkpoints/step_00000100')
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainConfig,
        train_data: Iterable[Batch],
        *,
        run_dir: str | Path,
        eval_data: Callable[[], Iterable[Batch]] | None = None,
        bytes_per_token: float | None = None,
        ds_config: dict | str | Path | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if eval_data is not None and not callable(eval_data):
            raise TypeError("eval_data must be a zero-argument callable returning an iterable of (inputs, targets)")
        if ds_config is not None and config.engine != "deepspeed":
            raise ValueError(f"ds_config given but TrainConfig.engine={config.engine!r}: set engine='deepspeed'")
        json.dumps(extra_state or {})  # fail now, not at the first checkpoint
        self.config = config
        self.run_dir = Path(run_dir)
        self.train_data = train_data
        self.eval_data = eval_data
        self.bytes_per_token = bytes_per_token
        self.extra_state = dict(extra_state or {})
        self.rank, self.world_size, self.device = setup_distributed(config.engine, config.dist_timeout_s)
        self.is_main = self.rank == 0
        if config.engine == "deepspeed":
            from trainloop.engine_deepspeed import DeepSpeedEngine

            self.engine: Any = DeepSpeedEngine(model, config, self.device, ds_config, self.world_size)
            for note in self.engine.notes:
                self._say(f"deepspeed config: {note}")
        else:
            self.engine = TorchEngine(model, config, self.device)
        self.clip_groups = ClipGroups(self.engine.names, config.clip_groups, config.clip)
        self.flops_per_token, self.flops_source = flops_per_token(model, config.flops_per_token)
        self.peak_tflops = config.peak_tflops or detect_peak_tflops(self.device)
        self.step = 0
        self.tokens_seen = 0
        self.consecutive_skips = 0
        self.total_skips = 0
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        self._signals = StopSignals()
        self._last_saved_step: int | None = None
        self._batch_checked = False

    # ----------------------------------------------------------------------------------------------- helpers
    def _say(self, msg: str) -> None:
        if self.is_main:
            print(f"[trainloop] {msg}", flush=True)

    def _seed(self) -> None:
        seed = self.config.seed + self.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _agree(self, loss: torch.Tensor, stop: bool) -> tuple[float, bool]:
        """Mean loss over ranks and whether any rank wants to stop, in one small all-reduce."""
        if self.world_size == 1:
            return float(loss), stop
        vec = all_reduce_sum(torch.tensor([float(loss), 1.0 if stop else 0.0], dtype=torch.float64))
        return float(vec[0]) / self.world_size, bool(vec[1] > 0)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step on every rank (collective); returns its directory."""
        tmp = self.run_dir / "checkpoints" / f".tmp-{step_dir_name(self.step)}"
        if self.is_main:
            begin_checkpoint(self.run_dir, self.step)
        barrier()
        client_state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "consecutive_skips": self.consecutive_skips,
            "total_skips": self.total_skips,
            "config": self.config.to_dict(),
            "extra_state": self.extra_state,
        }
        self.engine.save(tmp, client_state, self.rank)
        loader = self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None
        save_torch({"rng": rng_state(), "loader": loader}, tmp / f"rank{self.rank}.pt")
        if self.is_main:
            (tmp / "train_config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
            (tmp / "extra_state.json").write_text(json.dumps(self.extra_state, indent=1))
            if hasattr(self.engine, "ds_config"):
                (tmp / "ds_config.json").write_text(json.dumps(self.engine.ds_config, indent=1))
        barrier()
        final = tmp.parent / step_dir_name(self.step)
        if self.is_main:
            meta = {"world_size": self.world_size, "engine": self.engine.name, "tokens_seen": self.tokens_seen}
            finish_checkpoint(tmp, self.step, meta)
            prune_checkpoints(self.run_dir, self.config.keep_last)
        barrier()
        self._last_saved_step = self.step
        self._say(f"saved checkpoint {final}")
        return final

    def _find_resumable(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Rank 0 verifies the checkpoints (hashing is costly) and every rank loads its choice."""
        found = find_resumable(self.run_dir) if self.is_main else None
        if self.world_size > 1:
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        return found

    def load_checkpoint(self, ckpt: Path) -> None:
        """Restore everything a checkpoint holds; tensors land on this rank's device."""
        manifest = json.loads((ckpt / "manifest.json").read_text())
        saved_world, saved_engine = manifest.get("world_size", 1), manifest.get("engine", "torch")
        if saved_engine != self.engine.name:
            raise ValueError(f"{ckpt} was written by engine {saved_engine!r}; TrainConfig.engine={self.engine.name!r}")
        if saved_engine == "deepspeed" and saved_world != self.world_size:
            raise ValueError(
                f"{ckpt} was written by {saved_world} DeepSpeed ranks, this run has {self.world_size}: DeepSpeed "
                "checkpoints resume on the same world size (load_model_weights() loads the model anywhere)"
            )
        state = self.engine.load(ckpt)
        rank_file = ckpt / f"rank{self.rank}.pt"
        if not rank_file.exists():
            raise ValueError(
                f"{ckpt} has no state for rank {self.rank}: it was written by {saved_world} rank(s), this run has "
                f"{self.world_size}; resume with the same world size (load_model_weights() loads the model anywhere)"
            )
        per_rank = load_torch(rank_file)
        set_rng_state(per_rank["rng"])
        if per_rank["loader"] is not None and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(per_rank["loader"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.total_skips = int(state.get("total_skips", 0))
        self._last_saved_step = self.step
        self._say(f"resumed from {ckpt} at step {self.step}")

    # ----------------------------------------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float] | None:
        """Loss, perplexity and bits per byte on ``eval_data`` (None without eval data)."""
        if self.eval_data is None:
            return None
        return evaluate(
            self.engine.forward_eval,
            self.engine.module,
            self.eval_data,
            device=self.device,
            max_batches=self.config.eval_batches,
            bytes_per_token=self.bytes_per_token,
        )

    # ----------------------------------------------------------------------------------------------- one step
    def _next(self, it: Iterator[Batch]) -> Batch | None:
        try:
            inputs, targets = next(it)
        except StopIteration:
            return None
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def train_step(self, it: Iterator[Batch]) -> dict[str, Any] | None:
        """Accumulate ``grad_accum`` micro-batches, clip per group, step (or skip a non-finite step).

        Returns the step's record, or None when the data ran out before the step began.
        """
        cfg = self.config
        lr = lr_at(self.step, cfg)
        self.engine.set_lr(lr)
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for micro in range(cfg.grad_accum):
            batch = self._next(it)
            if batch is None:
                if micro == 0:
                    return None
                raise ValueError(f"train_data ran out inside an accumulation (micro-batch {micro} of {cfg.grad_accum})")
            inputs, targets = batch
            if not self._batch_checked:
                self._batch_checked = True
                if inputs.shape[0] != cfg.micro_batch:
                    self._say(
                        f"warning: train_data yields {inputs.shape[0]} rows per micro-batch, TrainConfig.micro_batch="
                        f"{cfg.micro_batch}: the loop trains on what it gets (DeepSpeed's batch sizes use micro_batch)"
                    )
            loss_sum += self.engine.micro_step(inputs, targets, micro == cfg.grad_accum - 1, cfg.grad_accum)
            tokens += targets.numel()
        loss_scale = self.engine.unscale()
        if self.step + 1 in cfg.inspect_steps:
            from trainloop.gradient_inspector import inspect_gradients

            inspect_gradients(self.engine.full_grads(), self.run_dir / "inspect", self.step + 1, self.clip_groups,
                              write=self.is_main)  # fmt: skip
        named, partitioned = self.engine.local_grads()
        report = self.clip_groups.clip(named, all_reduce=partitioned, unscale=loss_scale)
        if hasattr(self.engine, "after_clip"):
            self.engine.after_clip(named)
        budget = cfg.time_budget_s is not None and time.perf_counter() - self._t_start >= cfg.time_budget_s
        loss, stop = self._agree(loss_sum / cfg.grad_accum, self._signals.received is not None or budget)
        self._stop = stop and (self._stop_reason_local(budget) or "another rank stopped")
        skipped = False
        if math.isfinite(loss) and math.isfinite(report.total_norm):
            self.engine.step()
            self.consecutive_skips = 0
        else:
            self.engine.skip()
            skipped = True
            # fp16 overflow with a finite loss is GradScaler's business: it backs the scale off, not a fault.
            if not (cfg.precision == "fp16" and math.isfinite(loss)):
                self.consecutive_skips += 1
                self.total_skips += 1
        self.step += 1
        self.tokens_seen += tokens * self.world_size
        record: dict[str, Any] = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": report.total_norm}
        for g in self.clip_groups.group_names:
            record[f"grad_norm/{g}"] = report.norms[g]
            record[f"clip_factor/{g}"] = report.factors[g]
        record["tokens"] = tokens * self.world_size
        record["skipped"] = self.consecutive_skips if skipped else 0
        if loss_scale := self.engine.loss_scale():
            record["loss_scale"] = loss_scale
        return record

    def _stop_reason_local(self, budget: bool) -> str | None:
        if self._signals.received:
            return self._signals.received
        return "time_budget" if budget else None

    # ----------------------------------------------------------------------------------------------- the loop
    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Train to ``max_steps`` (or the time budget, or a signal); returns a summary.

        With ``resume=True`` the newest complete checkpoint in ``run_dir`` is restored first (incomplete ones are
        reported and skipped). Saves at every ``save_every`` steps and at the end; evaluates likewise.
        """
        cfg = self.config
        self._t_start = time.perf_counter()
        resume_step = None
        if resume:
            ckpt, self.skipped_checkpoints = self._find_resumable()
            for path, reason in self.skipped_checkpoints:
                self._say(f"skipping incomplete checkpoint {path.name}: {reason}")
            if ckpt is not None:
                self.load_checkpoint(ckpt)
                resume_step = self.step
            else:
                self._say(f"no complete checkpoint under {self.run_dir}: starting from step 0")
        if resume_step is None:
            self._seed()
        logger = MetricsLogger(self.run_dir, enabled=self.is_main, tensorboard=cfg.tensorboard, resume_step=resume_step)
        self._say(
            f"{self.engine.name} engine, {self.world_size} rank(s), {cfg.precision}, {self.flops_per_token:.3g} "
            f"FLOPs/token ({self.flops_source}), MFU peak "
            + (
                f"{self.peak_tflops} TFLOP/s per device"
                if self.peak_tflops
                else "unknown (set TrainConfig.peak_tflops)"
            )
        )
        self._signals.install()
        bar = None
        if cfg.progress and self.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", dynamic_ncols=True, leave=False)
        it = iter(self.train_data)
        summary: dict[str, Any] = {"stopped": None, "eval": None}
        last_record: dict[str, Any] | None = None
        window_tokens, window_t0 = 0, time.perf_counter()
        self._stop = False
        anomaly = torch.autograd.set_detect_anomaly(True) if cfg.detect_anomaly else None
        try:
            while self.step < cfg.max_steps:
                record = self.train_step(it)
                if record is None:
                    summary["stopped"] = "data_exhausted"
                    break
                last_record = record
                window_tokens += record.pop("tokens")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                if self.step % cfg.log_every == 0 or record["skipped"]:
                    now = time.perf_counter()
                    tps = window_tokens / max(now - window_t0, 1e-9)
                    window_tokens, window_t0 = 0, now
                    record["tokens_seen"] = self.tokens_seen
                    add_throughput(record, tps, self.device, self.flops_per_token, self.peak_tflops, self.world_size)
                    logger.log(record)
                    if self.is_main:
                        (bar.write if bar is not None else self._say)(format_line(record))
                if self.consecutive_skips >= cfg.max_consecutive_skips:
                    raise NonFiniteLossError(
                        f"{self.consecutive_skips} consecutive steps (to step {self.step}) had a non-finite loss or "
                        f"gradient norm (last loss {record['loss']}, grad norm {record['grad_norm']}). Try a lower lr "
                        f"(now {record['lr']:.3g}), a longer warmup, tighter clipping, precision='bf16' instead of "
                        "'fp16', or detect_anomaly=True to find the operation that produced it; check the data for "
                        "out-of-range token ids."
                    )
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                    summary["eval"] = self._eval_and_log(logger)
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
                if self._stop:
                    summary["stopped"] = self._stop
                    break
        except Exception as exc:
            if self.world_size > 1 and collective_failure(exc):
                raise RuntimeError(
                    f"rank {self.rank}: a collective operation failed at step {self.step} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}). Another rank most likely died or hung: read "
                    f"its log. Collectives wait at most TrainConfig.dist_timeout_s={self.config.dist_timeout_s} s."
                ) from exc
            raise
        finally:
            if anomaly is not None:
                torch.autograd.set_detect_anomaly(False)
            if bar is not None:
                bar.close()
            self._signals.restore()
        if summary["stopped"] not in ("SIGTERM", "SIGINT") and self.eval_data is not None:
            summary["eval"] = self._eval_and_log(logger)
        ckpt = self.save_checkpoint() if self._last_saved_step != self.step else None
        logger.close()
        last = self.run_dir / "checkpoints" / step_dir_name(self.step)
        summary.update(
            step=self.step,
            loss=last_record["loss"] if last_record else None,
            tokens_seen=self.tokens_seen,
            checkpoint=str(ckpt or last),
            total_skips=self.total_skips,
            wall_s=time.perf_counter() - self._t_start,
        )
        return summary

    def _eval_and_log(self, logger: MetricsLogger) -> dict[str, float] | None:
        result = self.evaluate()
        if result is not None:
            logger.log({"step": self.step, **{f"eval_{k}": v for k, v in result.items()}})
            self._say(f"eval at step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result
