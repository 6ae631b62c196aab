"""calibrate: clipping thresholds from a percentile of measured per-group gradient norms."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainloop.clipping import DEFAULT_GROUP, ClipGroups
from trainloop.config import TrainConfig
from trainloop.engine import trainable_names
from trainloop.trainer import Batch, Trainer


def calibrate(
    model: torch.nn.Module,
    config: TrainConfig,
    train_data: Iterable[Batch],
    *,
    run_dir: str | Path,
    patterns: list[str] | None = None,
    at_step: int = 500,
    n_batches: int = 100,
    percentile: float = 95.0,
    out: str | Path | None = None,
    ds_config: dict | str | Path | None = None,
    resume: bool = True,
) -> dict[str, Any]:
    """Train to ``at_step`` (resuming from ``run_dir`` when it has a checkpoint), then measure each group's gradient
    norm on ``n_batches`` further optimizer batches without stepping, and return (and write to ``out``) the
    ``percentile`` of each group as its threshold. Parameters matching no pattern are reported under the catch-all
    pattern ``"*"``, so the JSON can be handed straight to ``TrainConfig(clip_groups=path)``.

    The reference 1.3B recipe takes the 95th percentile over 100 batches at step 500.

    Example (a small regression model; the recipe's call on a language model is
    ``calibrate(model, cfg, loader, run_dir=..., patterns=["embed.*", "*.o_proj.*", "norm_f.*"], out="clip.json")``):
        >>> import tempfile, torch
        >>> from torch import nn
        >>> class Regression(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.hidden, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        ...     def forward(self, inputs, targets):
        ...         return nn.functional.mse_loss(self.out(torch.relu(self.hidden(inputs))), targets)
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(64, 4); y = x.sum(1, keepdim=True)
        >>> batches = ((x[i : i + 8], y[i : i + 8]) for _ in range(100) for i in range(0, 64, 8))
        >>> run = tempfile.TemporaryDirectory()
        >>> result = calibrate(Regression(), TrainConfig(lr=0.01), batches, run_dir=run.name, patterns=["hidden.*"],
        ...                    at_step=20, n_batches=10, percentile=95, out=f"{run.name}/clip.json")
        ... # doctest: +ELLIPSIS
        [trainloop ...] no checkpoint under ...: starting from step 0
        ...
        >>> sorted(result["thresholds"]), result["at_step"], len(result["norms"]["hidden.*"])  # "*": everything else
        (['*', 'hidden.*'], 20, 10)
        >>> TrainConfig(clip_groups=f"{run.name}/clip.json").clip_groups == result["thresholds"]
        True
        >>> run.cleanup()
    """
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile={percentile} must be in (0, 100]")
    if n_batches < 1:
        raise ValueError(f"n_batches={n_batches} must be >= 1")
    if at_step < 0:
        raise ValueError(f"at_step={at_step} must be >= 0")
    patterns = list(patterns if patterns is not None else (config.clip_groups or {}))
    run_cfg = dataclasses.replace(config, max_steps=max(at_step, 1), save_every=0, eval_every=0)
    trainer = Trainer(model, run_cfg, train_data, run_dir=run_dir, ds_config=ds_config)
    if at_step > 0:
        trainer.fit(resume=resume)
    # Thresholds of 0 measure without clipping; a step taken as non-finite drops the gradients, so the optimizer
    # never sees these batches.
    probe = ClipGroups(trainable_names(trainer.engine.module), dict.fromkeys(patterns, 0.0), 0.0)
    engine = trainer.engine
    it = iter(train_data)
    norms: dict[str, list[float]] = {g: [] for g in probe.group_names}
    for _ in range(n_batches):
        for micro in range(config.grad_accum):
            batch = trainer._next(it)
            if batch is None:
                raise ValueError(f"train_data ran out after {len(norms[DEFAULT_GROUP])} of {n_batches} batches")
            engine.backward(*batch, sync=micro == config.grad_accum - 1, divisor=float(config.grad_accum))
        report = engine.clip_and_step(probe, config.lr, loss_finite=False).clip
        for g, v in report.norms.items():
            norms[g].append(v)
    has_default = any(i == len(patterns) for i in probe.index_of.values())
    thresholds = {p: float(np.percentile(norms[p], percentile)) for p in patterns}
    if has_default:
        thresholds["*"] = float(np.percentile(norms[DEFAULT_GROUP], percentile))
    result = {
        "thresholds": thresholds,
        "percentile": percentile,
        "at_step": trainer.step if at_step > 0 else 0,
        "n_batches": n_batches,
        "norms": {("*" if g == DEFAULT_GROUP else g): v for g, v in norms.items() if g != DEFAULT_GROUP or has_default},
    }
    if out is not None and trainer.is_main:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        from trainloop.checkpoint import open_guarded

        with open_guarded(out) as f:  # never through a symbolic or hard link
            f.write(json.dumps(result, indent=1))
    return result
