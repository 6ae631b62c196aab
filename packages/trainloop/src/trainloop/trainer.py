"""Trainer: one visible loop over micro-batches, for any engine.

Each step the loop accumulates ``grad_accum`` micro-batches through the engine, agrees with the other ranks on the
loss, the signals and the time in one all-reduce, and has the engine clip and step. Then it asks its policies
(:mod:`trainloop.state`) whether to evaluate, save or stop; :class:`~trainloop.state.TrainState` is what it
carries across a resume.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainloop.checkpoint import (
    CheckpointError,
    CheckpointStore,
    is_checkpoint_name,
    load_torch,
    refuse_outside_links,
    rng_state,
    save_torch,
    set_rng_state,
)
from trainloop.clipping import ClipGroups
from trainloop.config import SEED_LIMIT, ConfigError, TrainConfig
from trainloop.distributed import all_reduce_sum, barrier, broadcast_json, setup_distributed, teardown_distributed
from trainloop.engine import Engine, StepReport, make_engine, micro_batch_divisors, scaled_loss, trainable_names
from trainloop.evaluation import evaluate
from trainloop.faults import (
    CollectiveError,
    NonFiniteLossError,
    StopSignals,
    collective_failure,
    disk_full_error,
    write_errno,
    write_failed_error,
)
from trainloop.metrics_logging import (
    MetricsLogger,
    add_throughput,
    detect_peak_tflops,
    flops_per_token,
    format_eval,
    format_line,
)
from trainloop.schedules import ConfigSchedule, Schedule
from trainloop.state import Agreement, BestTracker, CheckpointPolicy, EvalPolicy, TrainState

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100  # the label of a position that is not scored (prompt tokens, padding)
SIGNAL_STOP = "signal"


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: the step number after it, the learning rate it used, what the engine did (clipping,
    skip, loss scale), the tokens it trained on (all ranks) and what the ranks agreed on after it."""

    step: int
    lr: float
    report: StepReport
    tokens: int
    consecutive_skips: int
    agreed: Agreement

    def record(self) -> dict[str, Any]:
        """The metrics record of the step (metrics.jsonl, the console line, TensorBoard)."""
        clip = self.report.clip
        out: dict[str, Any] = {"step": self.step, "loss": self.agreed.loss, "lr": self.lr, "grad_norm": clip.total_norm}
        for g, norm in clip.norms.items():
            out[f"grad_norm/{g}"] = norm
            out[f"clip_factor/{g}"] = clip.factors[g]
        out["skipped"] = self.consecutive_skips if self.report.skipped else 0
        if self.report.loss_scale:
            out["loss_scale"] = self.report.loss_scale
        return out


class Trainer:
    """Trains any ``nn.Module`` whose ``model(inputs, targets)`` returns a loss (Tensor, ``.loss`` or ``["loss"]``),
    or a built :class:`~trainloop.engine.Engine` (:func:`~trainloop.engine.make_engine`).

    ``train_data`` yields (inputs, targets) micro-batches; with ``state_dict``/``load_state_dict`` its position is
    checkpointed. ``eval_data`` is a zero-argument callable returning an iterable of batches (each rank may yield its
    own share: the sums are all-reduced). ``extra_state`` (JSON-able) goes into every checkpoint. ``schedule`` is
    asked for every step's learning rate and the final step; it defaults to the config's closed form
    (:class:`~trainloop.schedules.ConfigSchedule`), and :class:`~trainloop.budget.BudgetSchedule` re-plans itself to
    the time budget while the loop runs. ``clock`` measures training time (budget, timed evaluations, re-plans,
    throughput); a test may pass a deterministic one. ``on_eval(step, result)`` runs on the main rank after each
    evaluation is logged (the app redraws its loss plot there, so that a run can be watched).

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
        model: torch.nn.Module | Engine,
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
        on_eval: Callable[[int, dict[str, float]], None] | None = None,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if eval_data is not None and not callable(eval_data):
            raise TypeError("eval_data must be a zero-argument callable returning an iterable of (inputs, targets)")
        json.dumps(extra_state or {})  # fail now, not at the first checkpoint
        if bytes_per_token is not None and not (
            isinstance(bytes_per_token, (int, float)) and not isinstance(bytes_per_token, bool)
            and math.isfinite(bytes_per_token) and bytes_per_token > 0
        ):  # fmt: skip
            raise ConfigError(f"bytes_per_token={bytes_per_token!r}: expected a finite number > 0 (UTF-8 bytes per "
                              "token of the evaluation text, for bits per byte) or None")  # fmt: skip
        if isinstance(model, torch.nn.Module):
            self.engine: Engine = make_engine(model, config, ds_config=ds_config)
        elif ds_config is not None:
            raise ConfigError("ds_config given with a built engine: pass it to make_engine instead")
        else:
            self.engine = model
        self.rank, self.world_size, self.device = setup_distributed(config.engine, config.dist_timeout_s)
        self.is_main = self.rank == 0
        self.config = config
        refuse_outside_links(run_dir)
        self.store = CheckpointStore(run_dir)
        self.run_dir = self.store.run_dir
        self.train_data = train_data
        self.eval_data = eval_data
        self.bytes_per_token = bytes_per_token
        self.extra_state = dict(extra_state or {})
        self.schedule: Schedule = schedule if schedule is not None else ConfigSchedule(config)
        for note in getattr(self.engine, "notes", []):
            self._say(f"deepspeed config: {note}")
        self.clip_groups = ClipGroups(trainable_names(self.engine.module), config.clip_thresholds, config.clip)
        self.flops_per_token, self.flops_source = flops_per_token(self.engine.module, config.flops_per_token)
        self.peak_tflops = config.peak_tflops or detect_peak_tflops(self.device)
        self.state = TrainState(next_eval_s=config.eval_every_s)
        self.eval_policy = EvalPolicy(config)
        self.best_tracker = BestTracker(config)
        self.checkpoint_policy = CheckpointPolicy(config)
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        self._signals = StopSignals()
        self._last_saved_step: int | None = None
        self._batch_checked = False
        self._clock = clock
        self.on_eval = on_eval  # called on the main rank after each evaluation is logged (step, result)
        self._fit_t0 = clock()

    # The loop's state, read by name.
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens_seen(self) -> int:
        return self.state.tokens_seen

    @property
    def total_skips(self) -> int:
        return self.state.total_skips

    @property
    def best(self) -> tuple[int, float] | None:
        return self.state.best

    def close(self) -> None:
        """Destroy the process group this Trainer set up (a no-op for one the caller initialised, or when called
        twice), and give SIGTERM back the handler it had before ``fit()`` (after ``fit()`` a first SIGTERM only lets
        the process finish: :class:`trainloop.faults.StopSignals`). Call it, or use the Trainer in a ``with`` block,
        once the run's collectives are over; a script that never does gets the process group's teardown at exit
        (:func:`trainloop.distributed.teardown_distributed`)."""
        self._signals.restore()
        teardown_distributed()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- helpers
    def _say(self, msg: str, bar: Any = None) -> None:
        """One timestamped line on rank 0 (through the progress bar's own write when a bar is showing), written
        whole: ``print`` under ``PYTHONUNBUFFERED=1`` sends the text and its newline as two writes, between which
        another rank's output on the same pipe can land."""
        if self.is_main:
            line = f"[trainloop {time.strftime('%H:%M:%S')}] {msg}\n"
            tqdm = sys.modules.get("tqdm")  # a bar, if any, came from tqdm: a line written past it would break it
            if bar is None and tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
                bar = tqdm.tqdm
            if bar is not None:
                bar.write(line, end="")
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    def _seed(self, offset: int = 0) -> None:
        seed = (self.config.seed + self.rank + 1_000_003 * offset) % SEED_LIMIT  # numpy's np.random.seed bound
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _elapsed(self) -> float:
        """Training seconds of the whole run: earlier processes (from the checkpoint) plus this fit()."""
        return self.state.train_seconds + self._clock() - self._fit_t0

    def _mean_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64))[0]) / self.world_size

    def _agree(self, loss: torch.Tensor) -> Agreement:
        """The mean loss, any rank signalled, any rank past the time budget, and the mean elapsed seconds, in one
        all-reduce, so that every rank takes the same decisions (stop, re-plan, evaluate) at the same step."""
        elapsed = self._elapsed()
        budget = self.config.time_budget_s is not None and elapsed >= self.config.time_budget_s
        vec = torch.tensor(
            [float(loss), self._signals.received is not None, budget, elapsed], dtype=torch.float64
        )  # fmt: skip
        if self.world_size > 1:
            vec = all_reduce_sum(vec)
            vec[0] /= self.world_size
            vec[3] /= self.world_size
        return Agreement(float(vec[0]), bool(vec[1] > 0), bool(vec[2] > 0), float(vec[3]))

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds besides the engine's own state: the loop's :class:`TrainState` (its training
        time brought up to now), the schedule's plan and ``extra_state``, shared by every rank; and under ``"rank"``
        this rank's RNG states and the data's position (``train_data.state_dict()`` where it has one)."""
        state = self.state.state_dict() | {"train_seconds": self._elapsed()}
        loader = self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None
        return {"trainer": state, "schedule": self.schedule.state_dict(), "extra_state": self.extra_state,
                "rank": {"rng": rng_state(), "loader": loader}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        """Restore what :meth:`state_dict` returned. ``rank_state`` is this rank's part; a rank without RNG states in
        it (None, or ``"rng": None``: the checkpoint was written by fewer ranks) is seeded from the seed, its rank
        and the step."""
        # Checkpoints written before TrainState kept its fields at the top level: the same names.
        self.state.load_state_dict(state.get("trainer", state))
        self.schedule.load_state_dict(state.get("schedule", {"kind": "config"}))
        if rank_state is not None and rank_state.get("rng") is not None:
            set_rng_state(rank_state["rng"])
        else:
            self._seed(offset=self.state.step)
        loader = (rank_state or {}).get("loader")
        if loader is not None and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(loader)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step on every rank (collective); returns its directory."""
        step = self.state.step
        tmp = self.store.tmp_dir(step)
        if self.is_main:
            self.store.begin(step)
        barrier()
        state = self.state_dict()
        rank_state = state.pop("rank")
        self.engine.save(tmp, state, self.rank)
        save_torch(rank_state, self.store.rank_file(tmp, self.rank))
        if self.is_main:
            for name, content in {
                "train_config.json": self.config.to_dict(),
                "extra_state.json": self.extra_state,
            }.items():
                (tmp / name).write_text(json.dumps(content, indent=1))
        barrier()
        final = self.store.step_dir(step)
        if self.is_main:
            meta = {"world_size": self.world_size, "engine": self.engine.name, "tokens_seen": self.state.tokens_seen}
            self.store.finish(tmp, step, meta)
            self.store.prune(self.config.keep_last, step)
        barrier()
        self._last_saved_step = step
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
                f"{ckpt} was written by engine {saved_engine!r}; TrainConfig.engine={self.engine.name!r} cannot "
                f"read it: resume with engine={saved_engine!r}"
            )
        if saved_world != self.world_size:
            self._say(f"{ckpt.name} was written by {saved_world} rank(s); resuming on {self.world_size}")
        state = self.engine.load(ckpt, saved_world)
        own = self.store.rank_file(ckpt, self.rank)
        per_rank = load_torch(own if own.exists() else self.store.rank_file(ckpt, 0))
        try:
            # The data's position of rank 0 when this rank has none; the RNG only from the rank's own file.
            self.load_state_dict(state, per_rank if own.exists() else {"rng": None, "loader": per_rank["loader"]})
        except ValueError as exc:
            raise CheckpointError(f"{ckpt}: {exc}; resume with the schedule the run was started with") from exc
        self._last_saved_step = self.state.step
        self._say(f"resumed from {ckpt} at step {self.state.step}")

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
            collective=getattr(self.engine, "collective_forward", False),
        )

    def _eval_and_track(self, logger: MetricsLogger) -> tuple[dict[str, float] | None, bool]:
        """Evaluate, log, keep the best checkpoint; returns (result, whether early stopping fires).

        The result is all-reduced, so every rank takes the same decisions.
        """
        step = self.state.step
        result = self.evaluate()
        if result is None:
            if self.eval_data is not None:
                self._say(f"evaluation at step {step} stopped by a signal (on this or another rank): not counted")
            return None, False
        logger.log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        self._say(f"eval at step {step}: {format_eval(result)}")
        if self.on_eval is not None and self.is_main:
            self.on_eval(step, result)
        improved, early = self.best_tracker.observe(self.state, result["loss"])
        if improved and self.config.keep_best:
            if self.checkpoint_policy.due_for_best(step, self._last_saved_step):
                self.save_checkpoint()
            if self.is_main:
                self.store.mark_best(step, "eval_loss", float(result["loss"]))
        return result, early

    # ----------------------------------------------------------------------------------------------- one step
    def _next(self, it: Iterator[Batch]) -> Batch | None:
        try:
            inputs, targets = next(it)
        except StopIteration:
            return None
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _step_batches(self, it: Iterator[Batch]) -> tuple[list[Batch], list[float]] | None:
        """The step's ``grad_accum`` micro-batches on the device and what each one's mean loss is divided by
        (:func:`~trainloop.engine.micro_batch_divisors`): the step's gradient is that of the mean loss over every
        scored target (labels other than -100) of the step, on every rank, however unevenly the micro-batches hold
        them. Returns None when the data ran out before the step began."""
        cfg = self.config
        batches, counts = [], []
        for micro in range(cfg.grad_accum):
            try:
                inputs, targets = next(it)
            except StopIteration:
                if micro == 0:
                    return None
                raise ValueError(
                    f"train_data ran out inside an accumulation (micro-batch {micro} of {cfg.grad_accum})"
                ) from None
            counts.append(int((targets != IGNORE_INDEX).sum()))  # on the host, before the copy: no device sync
            batches.append((inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)))
        total = float(sum(counts))
        if self.world_size > 1:
            total = float(all_reduce_sum(torch.tensor([total], dtype=torch.float64))[0])
        return batches, micro_batch_divisors(counts, self.world_size, total)

    def train_step(self, it: Iterator[Batch]) -> StepResult | None:
        """Accumulate ``grad_accum`` micro-batches, agree with the other ranks, clip per group and step (or skip a
        non-finite step). Returns the step's result, or None when the data ran out before the step began."""
        cfg, state = self.config, self.state
        lr = self.schedule.lr(state.step)
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        step = self._step_batches(it)
        if step is None:
            return None
        for micro, ((inputs, targets), divisor) in enumerate(zip(*step, strict=True)):
            if not self._batch_checked:
                self._batch_checked = True
                if inputs.shape[0] != cfg.micro_batch:
                    self._say(
                        f"warning: train_data yields {inputs.shape[0]} rows per micro-batch, TrainConfig.micro_batch="
                        f"{cfg.micro_batch}: the loop trains on what it gets (DeepSpeed's batch sizes use micro_batch)"
                    )
            loss = self.engine.backward(inputs, targets, sync=micro == cfg.grad_accum - 1, divisor=divisor)
            loss_sum += scaled_loss(loss, divisor)  # the ranks' mean of these sums: the step's mean loss
            tokens += targets.numel()
        agreed = self._agree(loss_sum)
        inspect = None
        if state.step + 1 in cfg.inspect_steps:
            from trainloop.gradient_inspector import inspect_gradients

            def inspect(grads):
                inspect_gradients(grads, self.run_dir / "inspect", state.step + 1, self.clip_groups, write=self.is_main)

        report = self.engine.clip_and_step(self.clip_groups, lr, loss_finite=np.isfinite(agreed.loss), inspect=inspect)
        if not report.skipped:
            state.consecutive_skips = 0
        elif not (cfg.precision == "fp16" and np.isfinite(agreed.loss)):
            # fp16 overflow with a finite loss is GradScaler's business: it backs the scale off, not a fault.
            state.consecutive_skips += 1
            state.total_skips += 1
        state.step += 1
        state.tokens_seen += tokens * self.world_size
        return StepResult(state.step, lr, report, tokens * self.world_size, state.consecutive_skips, agreed)

    # ----------------------------------------------------------------------------------------------- the loop
    def fit(
        self,
        resume: bool = False,
        *,
        overwrite: bool = False,
        verify: str = "sizes",
        on_ready: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Train to the schedule's final step (or the time budget, early stopping, a signal); returns a summary.

        With ``resume=True`` the newest complete checkpoint in ``run_dir`` is restored first (incomplete ones are
        reported and skipped; ``verify="full"`` also checks every SHA-256); without any checkpoint the run starts at
        step 0, and when there are checkpoints but none is usable it raises ``CheckpointError`` having changed
        nothing. ``on_ready`` is called on every rank once the run directory is known to be this run's (the
        checkpoint restored, or a fresh start allowed) and before the first step: the place to write files of one's
        own beside the checkpoints. A fresh run refuses a ``run_dir`` that
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
                resume_step = self.state.step
                self._fit_t0 = self._clock()  # training time restarts after the load (train_seconds holds the past)
            elif unusable := [(p, why) for p, why in self.skipped_checkpoints if is_checkpoint_name(p.name)]:
                # Starting over would replace what may still be recovered: the run stops, nothing is touched (an
                # interrupted save's temporary directory is no checkpoint).
                names = "; ".join(f"{p.name}: {why}" for p, why in unusable[:3])
                raise CheckpointError(
                    f"{self.store.root}: {len(unusable)} checkpoint(s), none usable ({names}): "
                    "nothing was changed; restore one, or start over (overwrite=True deletes them)"
                )
            else:
                self._say(f"no checkpoint under {self.run_dir}: starting from step 0")
        else:
            self._start_fresh(overwrite)
        if resume_step is None:
            self._seed()
        if on_ready is not None:
            on_ready()
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
        # save only sets the flag; after it, a SIGTERM waits for the process to finish (StopSignals.finish).
        self._signals.install()
        summary: dict[str, Any] = {"stopped": None, "eval": None, "loss": None}
        finished = False
        try:
            summary["stopped"], evaluated_at = self._loop(logger, summary)
            if summary["stopped"] != SIGNAL_STOP and self.eval_data is not None and evaluated_at != self.state.step:
                summary["eval"], _ = self._eval_and_track(logger)
                if summary["eval"] is None:  # a signal stopped it: the run was preempted, save and go
                    summary["stopped"] = SIGNAL_STOP
            ckpt = self.save_checkpoint() if self._last_saved_step != self.state.step else None
            finished = True
        except Exception as exc:
            code = write_errno(exc)
            if code in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(exc, self.store, self.engine.module, self.state.step) from exc
            if code is not None:
                raise write_failed_error(exc, code, self.store, self.state.step) from exc
            if self.world_size > 1 and collective_failure(exc):
                raise CollectiveError(
                    f"rank {self.rank}: a collective operation failed at step {self.state.step} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}). Another rank most likely died or hung: read "
                    f"its log. Collectives wait at most TrainConfig.dist_timeout_s={self.config.dist_timeout_s} s."
                ) from exc
            raise
        finally:
            if finished:  # a SIGTERM from now on lets the caller finish up instead of ending the process with -15
                self._signals.finish()
            else:
                self._signals.restore()
            logger.close()
        if summary["stopped"] == SIGNAL_STOP:
            summary["stopped"] = self._signals.received or "signal on another rank"
        best = self.state.best
        summary.update(
            step=self.state.step,
            tokens_seen=self.state.tokens_seen,
            checkpoint=str(ckpt or self.store.step_dir(self.state.step)),
            best={"step": best[0], "eval_loss": best[1]} if best else None,
            total_skips=self.state.total_skips,
            wall_s=time.perf_counter() - wall_t0,
        )
        note = f", best at step {best[0]} (eval loss {best[1]:.4f})" if best else ""
        self._say(f"stopped: {summary['stopped'] or 'planned end'} at step {self.state.step}{note}")
        return summary

    def _start_fresh(self, overwrite: bool) -> None:
        """Refuse (on every rank alike) to start over a run directory that holds checkpoints, unless overwriting."""
        existing = self.store.steps() if self.is_main else []
        found = all_reduce_sum(torch.tensor([float(len(existing))], dtype=torch.float64))
        if found.item() and not overwrite:
            where = f" (steps {existing[0]}..{existing[-1]})" if existing else ""
            raise CheckpointError(
                f"{self.store.root} already holds checkpoints{where}: resume them (resume=True) or delete them and "
                "start over (overwrite=True)"
            )
        if existing:
            self.store.clear()
        barrier()

    def _loop(self, logger: MetricsLogger, summary: dict[str, Any]) -> tuple[str | None, int | None]:
        """Steps until something stops the run; returns (why, the step of the last evaluation) and keeps the last
        loss and evaluation in ``summary``. Running to the schedule's last step returns None as the reason."""
        evaluated_at = None
        with _Progress(self, logger) as progress, _anomaly(self.config.detect_anomaly):
            it = iter(self.train_data)
            while self.state.step < self.schedule.max_steps:
                result = self.train_step(it)
                if result is None:
                    return "data_exhausted", evaluated_at
                summary["loss"] = result.agreed.loss
                progress.step(result)
                if result.agreed.signal:
                    return SIGNAL_STOP, evaluated_at
                early = False
                last = self.state.step >= self.schedule.max_steps or result.agreed.over_budget
                if self.eval_policy.due(self.state, result.agreed.elapsed, last=last):
                    summary["eval"], early, evaluated_at = *self._timed_eval(logger, result.agreed), self.state.step
                if self.checkpoint_policy.due(self.state.step, self._last_saved_step):
                    self.save_checkpoint()
                if early or result.agreed.over_budget:
                    return ("early_stopping" if early else "time_budget"), evaluated_at
        return None, evaluated_at

    def _timed_eval(self, logger: MetricsLogger, agreed: Agreement) -> tuple[dict[str, float] | None, bool]:
        t0 = self._clock()
        result, early = self._eval_and_track(logger)
        self.eval_policy.after(self.state, agreed.elapsed, self._mean_over_ranks(self._clock() - t0))
        return result, early


class _Progress:
    """What each step shows: the schedule's re-plans, the progress bar (rank 0 on a terminal), and every
    ``log_every`` steps (and every skipped step) the logged record with throughput; the non-finite stop."""

    def __init__(self, trainer: Trainer, logger: MetricsLogger) -> None:
        self.trainer, self.logger = trainer, logger
        self.bar: Any = None
        self.window_tokens, self.window_t0 = 0, trainer._clock()
        self.start_step, self.start_t = trainer.state.step, trainer._clock()

    def __enter__(self) -> _Progress:
        t, cfg = self.trainer, self.trainer.config
        if cfg.progress and t.is_main and sys.stderr.isatty() and not os.environ.get("TQDM_DISABLE"):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=t.schedule.max_steps, initial=t.state.step, desc="train", dynamic_ncols=True,
                            leave=False)  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def eta(self, result: StepResult, now: float) -> float:
        """Seconds left: the steps still planned at this fit's pace so far, or the time budget's rest if sooner."""
        cfg, done = self.trainer.config, result.step - self.start_step
        left = (self.trainer.schedule.max_steps - result.step) * (now - self.start_t) / max(done, 1)
        if cfg.time_budget_s is not None:
            left = min(left, cfg.time_budget_s - result.agreed.elapsed)
        return max(0.0, left)

    def step(self, result: StepResult) -> None:
        t, cfg = self.trainer, self.trainer.config
        record = result.record()
        self.window_tokens += result.tokens
        if (message := t.schedule.observe(result.step, result.agreed.elapsed)) is not None:
            t._say(message, self.bar)
            if self.bar is not None:
                self.bar.total = t.schedule.max_steps
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
        if result.step % cfg.log_every == 0 or record["skipped"]:
            now = t._clock()
            tps = self.window_tokens / max(now - self.window_t0, 1e-9)
            self.window_tokens, self.window_t0 = 0, now
            record["tokens_seen"] = t.state.tokens_seen
            record["eta_s"] = self.eta(result, now)
            add_throughput(record, tps, t.device, t.flops_per_token, t.peak_tflops, t.world_size)
            self.logger.log(record)
            t._say(format_line(record), self.bar)
        if t.state.consecutive_skips >= cfg.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{t.state.consecutive_skips} consecutive steps (to step {result.step}) had a non-finite loss or "
                f"gradient norm (last loss {record['loss']}, grad norm {record['grad_norm']}). Try a lower lr "
                f"(now {record['lr']:.3g}), a longer warmup, tighter clipping, precision='bf16' instead of "
                "'fp16', or detect_anomaly=True to find the operation that produced it; check the data for "
                "out-of-range token ids."
            )


class _anomaly:
    """``torch.autograd.set_detect_anomaly`` for the loop's duration when asked for."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        if self.on:
            torch.autograd.set_detect_anomaly(True)

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.autograd.set_detect_anomaly(False)
