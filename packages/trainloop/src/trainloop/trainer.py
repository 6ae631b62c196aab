"""Trainer: one visible loop over micro-batches, for the torch and DeepSpeed engines."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainloop.checkpoint import CheckpointError, CheckpointStore, load_torch, rng_state, save_torch, set_rng_state
from trainloop.clipping import ClipGroups
from trainloop.config import ConfigError, TrainConfig
from trainloop.distributed import all_reduce_sum, barrier, broadcast_json, setup_distributed, teardown_distributed
from trainloop.engine import Engine, set_lr
from trainloop.engine_torch import TorchEngine
from trainloop.evaluation import evaluate
from trainloop.faults import (
    CollectiveError,
    NonFiniteLossError,
    StopSignals,
    collective_failure,
    disk_full,
    disk_full_error,
)
from trainloop.metrics_logging import (
    MetricsLogger,
    add_throughput,
    detect_peak_tflops,
    flops_per_token,
    format_line,
)
from trainloop.schedules import ConfigSchedule, Schedule

Batch = tuple[torch.Tensor, torch.Tensor]
SIGNAL_STOP = "signal"
EVAL_SHARE = 0.1  # the most of the training time that evaluations every eval_every_s may take


class Trainer:
    """Trains any ``nn.Module`` whose ``model(inputs, targets)`` returns a loss (Tensor, ``.loss`` or ``["loss"]``).

    ``train_data`` yields (inputs, targets) micro-batches; with ``state_dict``/``load_state_dict`` its position is
    checkpointed. ``eval_data`` is a zero-argument callable returning an iterable of batches (each rank may yield its
    own share: the sums are all-reduced). ``extra_state`` (JSON-able) goes into every checkpoint. ``schedule`` is
    asked for every step's learning rate and the final step; it defaults to the config's closed form
    (:class:`~trainloop.schedules.ConfigSchedule`), and :class:`~trainloop.budget.BudgetSchedule` re-plans itself to
    the time budget while the loop runs. ``clock`` measures training time (budget, timed evaluations, re-plans,
    throughput); a test may pass a deterministic one.

    Example (a linear regression; any module whose forward returns the loss trains the same way):
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from torch import nn
        >>> class Regression(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.linear = nn.Linear(4, 1)
        ...     def forward(self, inputs, targets):
        ...         return nn.functional.mse_loss(self.linear(inputs), targets)
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(64, 4); y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        >>> batches = ((x[i : i + 8], y[i : i + 8]) for _ in range(100) for i in range(0, 64, 8))
        >>> model, run = Regression(), tempfile.TemporaryDirectory()
        >>> first_loss = model(x, y).item()
        >>> cfg = TrainConfig(max_steps=40, lr=0.1, log_every=20, save_every=20, clip=0.0, weight_decay=0.0)
        >>> summary = Trainer(model, cfg, batches, run_dir=run.name, eval_data=lambda: [(x, y)]).fit()
        ... # doctest: +ELLIPSIS
        [trainloop ...] torch engine, 1 rank(s), fp32, ...
        [trainloop ...] step 20 | loss ...
        [trainloop ...] saved checkpoint .../checkpoints/step_00000020
        ...
        [trainloop ...] eval at step 40: loss ...
        >>> summary["step"], Path(summary["checkpoint"]).name, summary["eval"]["loss"] < first_loss / 4
        (40, 'step_00000040', True)
        >>> run.cleanup()
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
        schedule: Schedule | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if eval_data is not None and not callable(eval_data):
            raise TypeError("eval_data must be a zero-argument callable returning an iterable of (inputs, targets)")
        if ds_config is not None and config.engine != "deepspeed":
            raise ConfigError(f"ds_config given but TrainConfig.engine={config.engine!r}: set engine='deepspeed'")
        json.dumps(extra_state or {})  # fail now, not at the first checkpoint
        self.config = config
        self.store = CheckpointStore(run_dir)
        self.run_dir = self.store.run_dir
        self.train_data = train_data
        self.eval_data = eval_data
        self.bytes_per_token = bytes_per_token
        self.extra_state = dict(extra_state or {})
        self.schedule: Schedule = schedule if schedule is not None else ConfigSchedule(config)
        self.rank, self.world_size, self.device = setup_distributed(config.engine, config.dist_timeout_s)
        self.is_main = self.rank == 0
        self.engine: Engine
        if config.engine == "deepspeed":
            from trainloop.engine_deepspeed import DeepSpeedEngine

            self.engine = DeepSpeedEngine(model, config, self.device, ds_config, self.world_size)
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
        self.train_seconds = 0.0  # training time of earlier processes of this run (resume), see _elapsed
        self.best: tuple[int, float] | None = None  # (step, eval loss)
        self.evals_since_best = 0
        self.next_eval_s = config.eval_every_s
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        self._signals = StopSignals()
        self._last_saved_step: int | None = None
        self._batch_checked = False
        self._clock = clock
        self._fit_t0 = clock()

    def close(self) -> None:
        """Destroy the process group this Trainer set up (a no-op for one the caller initialised, or when called
        twice). Call it, or use the Trainer in a ``with`` block, once the run's collectives are over; a script that
        never does gets the same at exit (:func:`trainloop.distributed.teardown_distributed`)."""
        teardown_distributed()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- helpers
    def _say(self, msg: str, bar: Any = None) -> None:
        """One timestamped line on rank 0 (through the progress bar's own write when a bar is showing)."""
        if self.is_main:
            line = f"[trainloop {time.strftime('%H:%M:%S')}] {msg}"
            bar.write(line) if bar is not None else print(line, flush=True)

    def _seed(self, offset: int = 0) -> None:
        seed = self.config.seed + self.rank + 1_000_003 * offset
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _elapsed(self) -> float:
        """Training seconds of the whole run: earlier processes (from the checkpoint) plus this fit()."""
        return self.train_seconds + self._clock() - self._fit_t0

    def _mean_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64))[0]) / self.world_size

    def _agree(self, loss: torch.Tensor) -> tuple[float, bool, bool, float]:
        """(mean loss, any rank signalled, any rank past the time budget, mean elapsed seconds) in one all-reduce,
        so that every rank takes the same decisions (stop, re-plan, evaluate) at the same step."""
        elapsed = self._elapsed()
        budget = self.config.time_budget_s is not None and elapsed >= self.config.time_budget_s
        vec = torch.tensor(
            [float(loss), self._signals.received is not None, budget, elapsed], dtype=torch.float64
        )  # fmt: skip
        if self.world_size > 1:
            vec = all_reduce_sum(vec)
            vec[0] /= self.world_size
            vec[3] /= self.world_size
        return float(vec[0]), bool(vec[1] > 0), bool(vec[2] > 0), float(vec[3])

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step on every rank (collective); returns its directory."""
        tmp = self.store.tmp_dir(self.step)
        if self.is_main:
            self.store.begin(self.step)
        barrier()
        client_state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "consecutive_skips": self.consecutive_skips,
            "total_skips": self.total_skips,
            "train_seconds": self._elapsed(),
            "best": list(self.best) if self.best else None,
            "evals_since_best": self.evals_since_best,
            "next_eval_s": self.next_eval_s,
            "schedule": self.schedule.state_dict(),
            "config": self.config.to_dict(),
            "extra_state": self.extra_state,
        }
        self.engine.save(tmp, client_state, self.rank)
        loader = self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None
        save_torch({"rng": rng_state(), "loader": loader}, self.store.rank_file(tmp, self.rank))
        if self.is_main:
            files = {"train_config.json": self.config.to_dict(), "extra_state.json": self.extra_state}
            for name, content in {**files, **self.engine.config_files()}.items():
                (tmp / name).write_text(json.dumps(content, indent=1))
        barrier()
        final = self.store.step_dir(self.step)
        if self.is_main:
            meta = {"world_size": self.world_size, "engine": self.engine.name, "tokens_seen": self.tokens_seen}
            self.store.finish(tmp, self.step, meta)
            self.store.prune(self.config.keep_last, self.step)
        barrier()
        self._last_saved_step = self.step
        self._say(f"saved checkpoint {final}")
        return final

    def _find_resumable(self, verify: str) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Rank 0 checks the checkpoints and every rank loads its choice."""
        ckpt, skipped = self.store.find_resumable(verify) if self.is_main else (None, [])
        if self.world_size > 1:
            sent = broadcast_json([None if ckpt is None else str(ckpt), [[str(p), why] for p, why in skipped]])
            ckpt, skipped = (None if sent[0] is None else Path(sent[0])), [(Path(p), why) for p, why in sent[1]]
        return ckpt, skipped

    def load_checkpoint(self, ckpt: Path) -> None:
        """Restore everything a checkpoint holds; tensors land on this rank's device.

        A checkpoint written by another number of ranks resumes too: the engine re-partitions its state, each rank
        restores its own RNG state where the checkpoint has one (a new rank is seeded from the seed, its rank and
        the step), and ``train_data`` gets the state of the same-numbered rank (else rank 0's); tokbin's loaders
        re-split the data stream over the new ranks from it.
        """
        manifest = json.loads((ckpt / "manifest.json").read_text())
        saved_world, saved_engine = int(manifest.get("world_size", 1)), manifest.get("engine", "torch")
        if saved_engine != self.engine.name:
            raise CheckpointError(
                f"{ckpt} was written by engine {saved_engine!r}; TrainConfig.engine={self.engine.name!r}"
            )
        if saved_world != self.world_size:
            self._say(f"{ckpt.name} was written by {saved_world} rank(s); resuming on {self.world_size}")
        state = self.engine.load(ckpt, saved_world)
        own = self.store.rank_file(ckpt, self.rank)
        per_rank = load_torch(own if own.exists() else self.store.rank_file(ckpt, 0))
        try:
            self.schedule.load_state_dict(state.get("schedule", {"kind": "config"}))
        except ValueError as exc:
            raise CheckpointError(f"{ckpt}: {exc}; resume with the schedule the run was started with") from exc
        self.step = int(state["step"])
        if own.exists():
            set_rng_state(per_rank["rng"])
        else:
            self._seed(offset=self.step)
        if per_rank["loader"] is not None and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(per_rank["loader"])
        self.tokens_seen = int(state["tokens_seen"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.total_skips = int(state.get("total_skips", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.best = tuple(state["best"]) if state.get("best") else None
        self.evals_since_best = int(state.get("evals_since_best", 0))
        self.next_eval_s = float(state.get("next_eval_s", self.config.eval_every_s))
        self._last_saved_step = self.step
        self._say(f"resumed from {ckpt} at step {self.step}")

    # ----------------------------------------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float] | None:
        """Loss, perplexity and bits per byte on ``eval_data`` (None without eval data, or when a signal on any
        rank stopped it: a preempted run saves at once instead of finishing a long evaluation first)."""
        if self.eval_data is None:
            return None
        return evaluate(
            self.engine.forward_eval,
            self.engine.module,
            self.eval_data,
            device=self.device,
            max_batches=self.config.eval_batches,
            bytes_per_token=self.bytes_per_token,
            stop=lambda: self._signals.received is not None,
        )

    def _eval_and_track(self, logger: MetricsLogger) -> tuple[dict[str, float] | None, bool]:
        """Evaluate, log, keep the best checkpoint; returns (result, whether early stopping fires).

        The result is all-reduced, so every rank takes the same decisions.
        """
        result = self.evaluate()
        if result is None:
            if self.eval_data is not None:
                self._say(f"evaluation at step {self.step} stopped by a signal (on this or another rank): not counted")
            return None, False
        logger.log({"step": self.step, **{f"eval_{k}": v for k, v in result.items()}})
        self._say(f"eval at step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        if self.best is None or result["loss"] < self.best[1]:
            self.best = (self.step, result["loss"])
            self.evals_since_best = 0
            if self.config.keep_best:
                if self._last_saved_step != self.step:
                    self.save_checkpoint()
                if self.is_main:
                    self.store.mark_best(self.step, "eval_loss", float(result["loss"]))
        else:
            self.evals_since_best += 1
        patience = self.config.early_stopping_patience
        return result, bool(patience and self.evals_since_best >= patience)

    # ----------------------------------------------------------------------------------------------- one step
    def _next(self, it: Iterator[Batch]) -> Batch | None:
        try:
            inputs, targets = next(it)
        except StopIteration:
            return None
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def train_step(self, it: Iterator[Batch]) -> dict[str, Any] | None:
        """Accumulate ``grad_accum`` micro-batches, clip per group, step (or skip a non-finite step).

        Returns the step's record (with the ranks' agreed ``signal``, ``budget`` and ``elapsed``), or None when the
        data ran out before the step began.
        """
        cfg = self.config
        lr = self.schedule.lr(self.step)
        set_lr(self.engine.optimizer, lr)
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
        self.engine.after_clip(named)
        loss, signal, budget, elapsed = self._agree(loss_sum / cfg.grad_accum)
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
        record.update(signal=signal, budget=budget, elapsed=elapsed)
        return record

    # ----------------------------------------------------------------------------------------------- the loop
    def fit(self, resume: bool = False, *, overwrite: bool = False, verify: str = "sizes") -> dict[str, Any]:
        """Train to the schedule's final step (or the time budget, early stopping, a signal); returns a summary.

        With ``resume=True`` the newest complete checkpoint in ``run_dir`` is restored first (incomplete ones are
        reported and skipped; ``verify="full"`` also checks every SHA-256). A fresh run refuses a ``run_dir`` that
        already holds checkpoints unless ``overwrite=True``, which deletes them. Saves at every ``save_every`` steps
        and at the end; evaluates likewise and at every ``eval_every_s`` seconds of training.
        """
        cfg = self.config
        wall_t0 = time.perf_counter()
        self._fit_t0 = self._clock()
        resume_step = None
        if resume:
            ckpt, self.skipped_checkpoints = self._find_resumable(verify)
            for path, reason in self.skipped_checkpoints:
                self._say(f"skipping incomplete checkpoint {path.name}: {reason}")
            if ckpt is not None:
                self.load_checkpoint(ckpt)
                resume_step = self.step
                self._fit_t0 = self._clock()  # training time restarts after the load (train_seconds holds the past)
            else:
                self._say(f"no complete checkpoint under {self.run_dir}: starting from step 0")
        else:
            self._start_fresh(overwrite)
        if resume_step is None:
            self._seed()
        logger = MetricsLogger(self.run_dir, enabled=self.is_main, tensorboard=cfg.tensorboard, resume_step=resume_step,
                               wandb_project=cfg.wandb_project)  # fmt: skip
        self._say(
            f"{self.engine.name} engine, {self.world_size} rank(s), {cfg.precision}, {self.flops_per_token:.3g} "
            f"FLOPs/token ({self.flops_source}), MFU peak "
            + (
                f"{self.peak_tflops} TFLOP/s per device"
                if self.peak_tflops
                else "unknown (set TrainConfig.peak_tflops)"
            )
        )
        # Handlers stay installed until the final checkpoint is written: a signal during the final evaluation or
        # save only sets the flag.
        self._signals.install()
        try:
            summary = self._loop(logger)
            if summary["stopped"] != SIGNAL_STOP and self.eval_data is not None and summary["eval_step"] != self.step:
                summary["eval"], _ = self._eval_and_track(logger)
                if summary["eval"] is None:  # a signal stopped it: the run was preempted, save and go
                    summary["stopped"] = SIGNAL_STOP
            ckpt = self.save_checkpoint() if self._last_saved_step != self.step else None
        except Exception as exc:
            if disk_full(exc):
                raise disk_full_error(exc, self.store, self.engine.module, self.step) from exc
            if self.world_size > 1 and collective_failure(exc):
                raise CollectiveError(
                    f"rank {self.rank}: a collective operation failed at step {self.step} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}). Another rank most likely died or hung: read "
                    f"its log. Collectives wait at most TrainConfig.dist_timeout_s={self.config.dist_timeout_s} s."
                ) from exc
            raise
        finally:
            self._signals.restore()
            logger.close()
        if summary["stopped"] == SIGNAL_STOP:
            summary["stopped"] = self._signals.received or "signal on another rank"
        summary.update(
            step=self.step,
            tokens_seen=self.tokens_seen,
            checkpoint=str(ckpt or self.store.step_dir(self.step)),
            best={"step": self.best[0], "eval_loss": self.best[1]} if self.best else None,
            total_skips=self.total_skips,
            wall_s=time.perf_counter() - wall_t0,
        )
        del summary["eval_step"]
        best = f", best at step {self.best[0]} (eval loss {self.best[1]:.4f})" if self.best else ""
        self._say(f"stopped: {summary['stopped'] or 'planned end'} at step {self.step}{best}")
        return summary

    def _start_fresh(self, overwrite: bool) -> None:
        """Refuse (on every rank alike) to start over a run directory that holds checkpoints, unless overwriting."""
        existing = self.store.steps() if self.is_main else []
        found = all_reduce_sum(torch.tensor([float(len(existing))], dtype=torch.float64))
        if found.item() and not overwrite:
            where = f" (steps {existing[0]}..{existing[-1]})" if existing else ""
            raise CheckpointError(
                f"{self.store.root} already holds checkpoints{where}: resume them (resume=True, lmtrain --resume) "
                "or delete them and start over (overwrite=True, lmtrain --overwrite)"
            )
        if existing:
            self.store.clear()
        barrier()

    def _loop(self, logger: MetricsLogger) -> dict[str, Any]:
        cfg = self.config
        bar = None
        if cfg.progress and self.is_main and sys.stderr.isatty() and not os.environ.get("TQDM_DISABLE"):
            from tqdm.auto import tqdm

            bar = tqdm(total=self.schedule.max_steps, initial=self.step, desc="train", dynamic_ncols=True, leave=False)
        it = iter(self.train_data)
        summary: dict[str, Any] = {"stopped": None, "eval": None, "eval_step": None, "loss": None}
        window_tokens, window_t0 = 0, self._clock()
        anomaly = torch.autograd.set_detect_anomaly(True) if cfg.detect_anomaly else None
        try:
            while self.step < self.schedule.max_steps:
                record = self.train_step(it)
                if record is None:
                    summary["stopped"] = "data_exhausted"
                    break
                signal, budget, elapsed = record.pop("signal"), record.pop("budget"), record.pop("elapsed")
                summary["loss"] = record["loss"]
                window_tokens += record.pop("tokens")
                if (message := self.schedule.observe(self.step, elapsed)) is not None:
                    self._say(message, bar)
                    if bar is not None:
                        bar.total = self.schedule.max_steps
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
                if self.step % cfg.log_every == 0 or record["skipped"]:
                    now = self._clock()
                    tps = window_tokens / max(now - window_t0, 1e-9)
                    window_tokens, window_t0 = 0, now
                    record["tokens_seen"] = self.tokens_seen
                    add_throughput(record, tps, self.device, self.flops_per_token, self.peak_tflops, self.world_size)
                    logger.log(record)
                    self._say(format_line(record), bar)
                if self.consecutive_skips >= cfg.max_consecutive_skips:
                    raise NonFiniteLossError(
                        f"{self.consecutive_skips} consecutive steps (to step {self.step}) had a non-finite loss or "
                        f"gradient norm (last loss {record['loss']}, grad norm {record['grad_norm']}). Try a lower lr "
                        f"(now {record['lr']:.3g}), a longer warmup, tighter clipping, precision='bf16' instead of "
                        "'fp16', or detect_anomaly=True to find the operation that produced it; check the data for "
                        "out-of-range token ids."
                    )
                if signal:
                    summary["stopped"] = SIGNAL_STOP
                    break
                early = False
                last = self.step >= self.schedule.max_steps or budget
                by_time = cfg.eval_every_s > 0 and elapsed >= self.next_eval_s
                if by_time:
                    while self.next_eval_s <= elapsed:
                        self.next_eval_s += cfg.eval_every_s
                if not last and ((cfg.eval_every and self.step % cfg.eval_every == 0) or by_time):
                    t0 = self._clock()
                    summary["eval"], early = self._eval_and_track(logger)
                    summary["eval_step"] = self.step
                    if cfg.eval_every_s:
                        # Timed evaluations (and the best checkpoints they save) take at most EVAL_SHARE of the
                        # time: the next one waits for cost / EVAL_SHARE seconds. The ranks' mean cost keeps the
                        # decision identical everywhere.
                        cost = self._mean_over_ranks(self._clock() - t0)
                        self.next_eval_s = max(self.next_eval_s, elapsed + cost / EVAL_SHARE)
                if cfg.save_every and self.step % cfg.save_every == 0 and self._last_saved_step != self.step:
                    self.save_checkpoint()
                if early or budget:
                    summary["stopped"] = "early_stopping" if early else "time_budget"
                    break
        finally:
            if anomaly is not None:
                torch.autograd.set_detect_anomaly(False)
            if bar is not None:
                bar.close()
        return summary
