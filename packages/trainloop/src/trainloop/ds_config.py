"""Reconcile a DeepSpeed JSON config with TrainConfig: fill in what is missing, refuse what disagrees."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from trainloop.config import ConfigError, TrainConfig


def load_ds_config(source: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"ds_config: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"ds_config: {path} must hold a JSON object")
    return data


def build_ds_config(
    source: dict[str, Any] | str | Path | None, config: TrainConfig, world_size: int, *, on_cpu: bool
) -> tuple[dict[str, Any], list[str]]:
    """The config handed to ``deepspeed.initialize`` and notes on what was changed and why.

    Batch sizes: ``train_batch_size = micro_batch * grad_accum * world_size``; keys the source sets must agree with
    TrainConfig (a ValueError names both); missing keys are filled in. The loop owns the optimizer (torch AdamW with
    TrainConfig's values), the schedule and the clipping, so an ``optimizer``/``scheduler`` block is dropped and
    ``gradient_clipping`` is forced to 0.

    Example:
        >>> cfg = TrainConfig(micro_batch=4, grad_accum=2)
        >>> ds, notes = build_ds_config({"zero_optimization": {"stage": 2}}, cfg, 2, on_cpu=True)
        >>> ds["train_batch_size"]
        16
    """
    ds = load_ds_config(source)
    notes: list[str] = []
    micro, accum = config.micro_batch, config.grad_accum
    want = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    for key, ours in want.items():
        if key in ds and ds[key] != ours:
            field = "micro_batch" if key.startswith("train_micro") else "grad_accum"
            raise ConfigError(
                f"ds_config {key}={ds[key]} disagrees with TrainConfig.{field}={ours}: set {field}={ds[key]} "
                f"or remove {key} from the DeepSpeed config"
            )
        ds[key] = ours
    total = micro * accum * world_size
    if "train_batch_size" in ds and ds["train_batch_size"] != total:
        tbs = ds["train_batch_size"]
        hint = tbs / (accum * world_size)
        fix = f"micro_batch={int(hint)}" if hint == int(hint) else "a micro_batch that divides it"
        raise ConfigError(
            f"ds_config train_batch_size={tbs} but TrainConfig.micro_batch={micro} x grad_accum={accum} x "
            f"world_size={world_size} = {total}: set {fix} or change train_batch_size"
        )
    ds["train_batch_size"] = total
    if "optimizer" in ds:
        opt = ds.pop("optimizer")
        kind = str(opt.get("type", "")).lower()
        if kind not in ("adam", "adamw"):
            raise ConfigError(f"ds_config optimizer type {opt.get('type')!r}: the loop trains with AdamW only")
        notes.append(f"optimizer block {opt} replaced by torch AdamW with TrainConfig lr={config.lr} and its schedule")
    if "scheduler" in ds:
        ds.pop("scheduler")
        notes.append(f"scheduler block dropped: the loop applies TrainConfig.schedule={config.schedule!r}")
    if ds.get("gradient_clipping", 0):
        notes.append(
            f"gradient_clipping={ds['gradient_clipping']} set to 0: the loop clips per group (TrainConfig.clip)"
        )
    ds["gradient_clipping"] = 0.0
    for key, name in (("fp16", "fp16"), ("bf16", "bf16")):
        enabled = bool(ds.get(key, {}).get("enabled", False))
        if enabled and config.precision != name:
            raise ConfigError(
                f"ds_config enables {key} but TrainConfig.precision={config.precision!r}: make them agree"
            )
    if config.precision == "fp16":
        if on_cpu:
            raise ConfigError("TrainConfig.precision='fp16' does not work with DeepSpeed on CPU: use 'bf16' or 'fp32'")
        ds.setdefault("fp16", {}).update(
            enabled=True,
            initial_scale_power=int(math.log2(config.scaler_init_scale)),
            loss_scale_window=config.scaler_growth_interval,
        )
    elif config.precision == "bf16":
        ds.setdefault("bf16", {})["enabled"] = True
    zero = ds.setdefault("zero_optimization", {})
    zero.setdefault("stage", config.zero_stage)
    if zero["stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config zero_optimization.stage={zero['stage']}: allowed values are 0, 1, 2, 3")
    # Our optimizer is torch AdamW; DeepSpeed would otherwise insist on its own CPU Adam when offloading.
    ds["zero_force_ds_cpu_optimizer"] = False
    ds["zero_allow_untested_optimizer"] = True
    ds.setdefault("steps_per_print", 10**9)
    return ds, notes
