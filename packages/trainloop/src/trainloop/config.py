"""TrainConfig: every knob of the loop in one flat, validated dataclass."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

ScheduleName = Literal["cosine", "constant", "wsd"]
Precision = Literal["fp32", "bf16", "fp16"]
EngineName = Literal["torch", "deepspeed", "fsdp"]
FSDPCheckpoint = Literal["sharded", "full"]
Verify = Literal["sizes", "full"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
PRECISIONS: tuple[str, ...] = get_args(Precision)
ENGINES: tuple[str, ...] = get_args(EngineName)
FSDP_CHECKPOINTS: tuple[str, ...] = get_args(FSDPCheckpoint)
SEED_LIMIT = 2**32  # random, numpy and torch all take a seed below this; the Trainer seeds each rank modulo it


class ConfigError(ValueError):
    """A TrainConfig or DeepSpeed config value that cannot work; the message names the field and what is allowed."""


@dataclass
class TrainConfig:
    """Hyper-parameters and intervals of one training run.

    Intervals count optimizer steps; 0 turns the periodic action off (the end of the run still evaluates and saves).
    ``clip_groups`` maps fnmatch patterns over parameter names to thresholds (first match wins, unmatched
    parameters form the group ``"default"`` clipped at ``clip``); it may also be the path of a JSON file written by
    :func:`trainloop.calibrate`. ``clip=0`` with no groups disables clipping.

    Example:
        >>> cfg = TrainConfig(lr=3e-4, min_lr=1e-6, warmup_steps=500, t_max=10_000, max_steps=10_000,
        ...                   clip_groups={"*embed*": 2.0, "*.o_proj.*": 0.5, "norm_f.*": 0.1}, precision="bf16")
        >>> cfg.engine, cfg.clip  # "default": the parameters no pattern matches
        ('torch', 1.0)
        >>> TrainConfig(precision="fp8")
        Traceback (most recent call last):
        trainloop.config.ConfigError: TrainConfig.precision='fp8' is invalid: allowed values are fp32, bf16, fp16
    """

    # Optimiser and schedule (linear warmup from min_lr to lr, then the schedule down to min_lr at t_max).
    lr: float = 3e-4
    min_lr: float = 1e-6
    warmup_steps: int = 0
    schedule: ScheduleName = "cosine"
    t_max: int | None = None  # step where the decay reaches min_lr; None means max_steps
    wsd_decay_steps: int | None = None  # WSD: length of the final decay; None means 10% of t_max
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Batching and precision.
    max_steps: int = 1000
    micro_batch: int = 8
    grad_accum: int = 1
    precision: Precision = "fp32"
    scaler_init_scale: float = 65536.0
    scaler_growth_factor: float = 2.0
    scaler_backoff_factor: float = 0.5
    scaler_growth_interval: int = 2000
    # Clipping.
    clip: float = 1.0
    clip_groups: dict[str, float] | str | None = None
    # Intervals and bookkeeping.
    log_every: int = 10
    eval_every: int = 0
    eval_every_s: float = 0.0  # also evaluate each time this many seconds of training have passed (0: off)
    eval_batches: int | None = None
    # Each evaluation that improves the loss makes its step's checkpoint the run's best (checkpoints/best.json);
    # after early_stopping_patience evaluations in a row without improvement the run stops (0: never).
    keep_best: bool = True
    early_stopping_patience: int = 0
    save_every: int = 0
    keep_last: int = 3
    seed: int = 0
    time_budget_s: float | None = None
    # Engine and faults.
    engine: EngineName = "torch"
    zero_stage: int = 2  # used when the DeepSpeed config names no stage
    # engine="fsdp": the class names of the modules sharded each on their own (None: the model's shard_units(), else
    # the blocks of its largest nn.ModuleList), parameters and gradients offloaded to host memory, and checkpoints
    # as one torch.distributed.checkpoint shard per rank ("sharded") or whole on rank 0, broadcast on load ("full").
    fsdp_units: list[str] | None = None
    fsdp_cpu_offload: bool = False
    fsdp_checkpoint: FSDPCheckpoint = "sharded"
    # Reduce-scatter the gradients on every micro-batch instead of only the last: grad_accum times the gradient
    # traffic, but no unsharded fp32 gradients kept between micro-batches (4 bytes per parameter on every rank).
    fsdp_sync_every_micro: bool = False
    max_consecutive_skips: int = 5
    detect_anomaly: bool = False
    dist_timeout_s: float = 600.0
    # Reporting.
    peak_tflops: float | None = None  # per device, for MFU; None: MFU is not reported
    flops_per_token: float | None = None  # None: 6 * n_params (or the model's own figure)
    inspect_steps: list[int] = field(default_factory=list)
    progress: bool = True
    tensorboard: bool = False  # scalars under run_dir/tensorboard (the `tensorboard` extra)
    wandb_project: str | None = None  # a Weights & Biases project to log to (the `wandb` extra); None: off

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: {allowed}")

        def positive_float(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            need(
                ok and (v >= 0 if allow_zero else v > 0),
                name,
                "must be a finite number " + (">= 0" if allow_zero else "> 0"),
            )

        def int_at_least(name: str, low: int) -> None:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= low, name, f"must be an integer >= {low}")

        positive_float("lr")
        positive_float("min_lr", allow_zero=True)
        need(self.min_lr <= self.lr, "min_lr", f"must not exceed lr={self.lr}")
        int_at_least("warmup_steps", 0)
        need(self.schedule in SCHEDULES, "schedule", f"allowed values are {', '.join(SCHEDULES)}")
        int_at_least("max_steps", 1)
        if self.t_max is None:
            self.t_max = self.max_steps
        int_at_least("t_max", 1)
        if self.wsd_decay_steps is not None:
            int_at_least("wsd_decay_steps", 0)
            need(self.wsd_decay_steps <= self.t_max - self.warmup_steps, "wsd_decay_steps", "must fit after warmup")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and 0 <= v < 1, name, "must be in [0, 1)")
        positive_float("eps")
        positive_float("weight_decay", allow_zero=True)
        int_at_least("micro_batch", 1)
        int_at_least("grad_accum", 1)
        need(self.precision in PRECISIONS, "precision", f"allowed values are {', '.join(PRECISIONS)}")
        positive_float("scaler_init_scale")
        need(isinstance(self.scaler_growth_factor, (int, float)) and self.scaler_growth_factor > 1,
             "scaler_growth_factor", "must be > 1 (e.g. 1.001 for a slowly growing fp16 scale)")  # fmt: skip
        need(isinstance(self.scaler_backoff_factor, (int, float)) and 0 < self.scaler_backoff_factor < 1,
             "scaler_backoff_factor", "must be in (0, 1)")  # fmt: skip
        int_at_least("scaler_growth_interval", 1)
        positive_float("clip", allow_zero=True)
        if isinstance(self.clip_groups, (str, Path)):
            self.clip_groups = load_clip_groups(self.clip_groups)
        if self.clip_groups is not None:
            need(
                isinstance(self.clip_groups, dict), "clip_groups", "must be a dict {pattern: threshold} or a JSON path"
            )
            for pattern, value in self.clip_groups.items():
                ok = isinstance(pattern, str) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                need(ok, "clip_groups", f"entry {pattern!r}: {value!r} must map a pattern string to a threshold > 0")
        for name in ("log_every", "eval_every", "save_every"):
            int_at_least(name, 0)
        need(self.log_every >= 1, "log_every", "must be >= 1")
        positive_float("eval_every_s", allow_zero=True)
        need(isinstance(self.keep_best, bool), "keep_best", "must be true or false")
        int_at_least("early_stopping_patience", 0)
        if self.eval_batches is not None:
            int_at_least("eval_batches", 1)
        int_at_least("keep_last", 1)
        int_at_least("seed", 0)
        need(self.seed < SEED_LIMIT, "seed", f"must be below 2**32 ({SEED_LIMIT}), numpy's limit")
        if self.time_budget_s is not None:
            positive_float("time_budget_s")
        need(self.engine in ENGINES, "engine", f"allowed values are {', '.join(ENGINES)}")
        need(self.zero_stage in (0, 1, 2, 3), "zero_stage", "allowed values are 0, 1, 2, 3")
        self._check_fsdp(need)
        int_at_least("max_consecutive_skips", 1)
        need(isinstance(self.detect_anomaly, bool), "detect_anomaly", "must be true or false")
        positive_float("dist_timeout_s")
        if self.peak_tflops is not None:
            positive_float("peak_tflops")
        if self.flops_per_token is not None:
            positive_float("flops_per_token")
        steps = self.inspect_steps
        need(isinstance(steps, (list, tuple)) and all(isinstance(s, int) and s >= 1 for s in steps),
             "inspect_steps", "must be a list of step numbers >= 1")  # fmt: skip
        self.inspect_steps = list(steps)
        need(isinstance(self.tensorboard, bool), "tensorboard", "must be true or false")
        need(self.wandb_project is None or (isinstance(self.wandb_project, str) and self.wandb_project.strip() != ""),
             "wandb_project", "must be a W&B project name or None (off)")  # fmt: skip

    def _check_fsdp(self, need: Callable[[bool, str, str], None]) -> None:
        units = self.fsdp_units
        need(units is None or (isinstance(units, (list, tuple)) and len(units) > 0
             and all(isinstance(u, str) and u for u in units)), "fsdp_units",
             "must be None (found from the model) or a non-empty list of module class names")  # fmt: skip
        self.fsdp_units = None if units is None else list(units)
        need(isinstance(self.fsdp_cpu_offload, bool), "fsdp_cpu_offload", "must be true or false")
        need(isinstance(self.fsdp_sync_every_micro, bool), "fsdp_sync_every_micro", "must be true or false")
        need(self.fsdp_checkpoint in FSDP_CHECKPOINTS, "fsdp_checkpoint",
             f"allowed values are {', '.join(FSDP_CHECKPOINTS)}")  # fmt: skip
        fsdp = self.engine == "fsdp"
        defaults = {"fsdp_units": None, "fsdp_cpu_offload": False, "fsdp_checkpoint": "sharded",
                    "fsdp_sync_every_micro": False}  # fmt: skip
        for name, default in defaults.items():
            need(fsdp or getattr(self, name) == default, name,
                 f"applies to engine='fsdp' only (engine={self.engine!r}); drop it or set engine='fsdp'")  # fmt: skip
        need(not (fsdp and self.precision == "fp16"), "precision",
             "'fp16' needs a loss scaler that agrees across shards, which engine='fsdp' does not have: use 'bf16' "
             "(no scaler needed) or engine='torch'/'deepspeed' for fp16")  # fmt: skip

    @property
    def clip_thresholds(self) -> dict[str, float] | None:
        """``clip_groups`` as a mapping (a file path given to the config was read when it was built)."""
        groups = self.clip_groups
        return groups if isinstance(groups, dict) else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``TrainConfig(**d)`` rebuilds the config."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict, naming any unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"TrainConfig has no field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def load_clip_groups(path: str | Path) -> dict[str, float]:
    """Read clipping thresholds written by :func:`trainloop.calibrate` (``{"thresholds": {...}}``) or a plain dict."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"TrainConfig.clip_groups: cannot read thresholds from {p}: {exc}") from exc
    groups = data.get("thresholds", data) if isinstance(data, dict) else None
    if not isinstance(groups, dict):
        raise ConfigError(f"TrainConfig.clip_groups: {p} holds no {{pattern: threshold}} mapping")
    return {str(k): float(v) for k, v in groups.items()}
