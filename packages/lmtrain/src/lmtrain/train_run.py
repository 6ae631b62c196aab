"""`lmtrain train`: an lmcore GPT on tokbin batches through a trainloop Trainer.

Single process by default; under torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK in the
environment) every rank runs this same code: each draws its own rows of the global batch and trainloop sets up
the process group. `--deepspeed` switches the engine to DeepSpeed with the given JSON config.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError, OverrideError
from lmtrain.overrides import apply_overrides, parse_pairs
from lmtrain.recipes import DEFAULT_PRESET, DataConfig, data_recipe, train_recipe
from lmtrain.run_files import RUN_FILE, TOKENIZER_FILE, read_meta, read_run, write_json_atomic

# Fraction of the measured speed the schedule is sized to, so the cosine decay ends before the budget even when
# the machine slows down a little (other work on the same cores).
BUDGET_SAFETY = 0.92


def matching_preset(model_config: Any) -> str | None:
    """The preset with the same layer count, heads and width as `model_config` (its recipe then applies)."""
    from lmcore import PRESETS

    for name, values in PRESETS.items():
        if all(values.get(k) == getattr(model_config, k) for k in ("n_layer", "n_head", "d_model")):
            return name
    return None


def build_configs(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[Any, Any, DataConfig, str | None]:
    """(ModelConfig, TrainConfig, DataConfig, recipe name) from the flags, the data and the run's saved configs."""
    from lmcore import ModelConfig
    from lmtrain.model_setup import base_model_config
    from trainloop import TrainConfig

    run_json = Path(args.out) / RUN_FILE
    if args.resume and run_json.is_file():
        # A resumed run keeps the configs it started with (a recalibrated schedule would change its future).
        run = read_run(args.out)
        model_cfg = ModelConfig.from_dict(run["model_config"])
        train_cfg = TrainConfig.from_dict(run["train_config"])
        data_cfg = DataConfig(**run["data_config"])
        recipe = run.get("recipe")
    else:
        model_cfg = base_model_config(
            None if args.model_config else (args.preset or DEFAULT_PRESET), args.model_config, meta["vocab_size"]
        )
        recipe = args.preset or (DEFAULT_PRESET if not args.model_config else matching_preset(model_cfg))
        values = train_recipe(recipe)
        values["engine"] = "deepspeed" if args.deepspeed else "torch"
        train_cfg = TrainConfig.from_dict(values)
        data_cfg = DataConfig(**data_recipe(recipe))
    pairs = list(args.overrides)
    set_keys = {key.split(".")[-1] for key, _ in parse_pairs(pairs)}
    if args.time_budget is not None:
        pairs.append(f"train.time_budget_s={args.time_budget}")
    if args.deepspeed:
        pairs.append("train.engine=deepspeed")
    configs = apply_overrides(pairs, {"model": model_cfg, "train": train_cfg, "data": data_cfg})
    if args.max_steps is not None:
        # The decay ends where the run ends, unless t_max is set explicitly; a warmup longer than the run shrinks.
        cfg = configs["train"]
        t_max = cfg.t_max if "t_max" in set_keys else args.max_steps
        warmup = cfg.warmup_steps if cfg.warmup_steps <= t_max else t_max // 10
        try:
            configs["train"] = dataclasses.replace(cfg, max_steps=args.max_steps, t_max=t_max, warmup_steps=warmup)
        except ValueError as exc:
            raise OverrideError(f"--max-steps {args.max_steps}: {exc}") from exc
    model_cfg, train_cfg, data_cfg = configs["model"], configs["train"], configs["data"]
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise LmtrainError(
            f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {meta['vocab_size']}: token ids would index "
            "past the embedding table"
        )
    if data_cfg.seq_len is None:
        data_cfg = dataclasses.replace(data_cfg, seq_len=model_cfg.context_length)
    return model_cfg, train_cfg, data_cfg, recipe


def calibrate_steps_per_s(model: Any, train_cfg: Any, data_cfg: DataConfig, vocab_size: int) -> float:
    """Optimizer steps per second of this configuration, timed on a throw-away copy with random tokens."""
    import torch

    probe = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-9)
    shape = (train_cfg.micro_batch, data_cfg.seq_len)
    timings = []
    for _ in range(data_cfg.calibrate_steps + 1):  # the first step pays one-off allocation costs
        ids = torch.randint(0, vocab_size, shape)
        t0 = time.perf_counter()
        for _ in range(train_cfg.grad_accum):
            loss = probe(ids, ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timings.append(time.perf_counter() - t0)
    del probe, optimizer
    timings = sorted(timings[1:])
    return 1.0 / timings[len(timings) // 2]


def val_batches(token_file: Any, seq_len: int, batch_size: int):
    """A zero-argument callable yielding consecutive, non-overlapping (inputs, targets) windows of the val split."""
    import numpy as np

    def batches():
        starts = np.arange(0, token_file.n_tokens - seq_len - 1, seq_len, dtype=np.int64)
        for i in range(0, len(starts), batch_size):
            yield token_file.gather(starts[i : i + batch_size], seq_len)

    return batches


def run_train(args: argparse.Namespace) -> int:
    """The `lmtrain train` command."""
    t_start = time.perf_counter()
    import torch

    import tokbin
    from lmcore import GPT, n_params
    from trainloop import Trainer, plot_metrics

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    meta = read_meta(args.data)
    model_cfg, train_cfg, data_cfg, recipe = build_configs(args, meta)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(train_cfg.seed)
    model = GPT(model_cfg)
    resumed = args.resume and (run_dir / RUN_FILE).is_file()
    calibrated = None
    if args.time_budget is not None and args.max_steps is None and not resumed and world_size == 1:
        # Size the schedule to the budget: max_steps (and the cosine's t_max) = what the budget allows.
        speed = calibrate_steps_per_s(model, train_cfg, data_cfg, model_cfg.vocab_size)
        left = args.time_budget - (time.perf_counter() - t_start)
        steps = max(1, int(left * speed * BUDGET_SAFETY))
        warmup = min(train_cfg.warmup_steps, steps // 5)
        # A short budget still logs about 20 points for the curve.
        log_every = max(1, min(train_cfg.log_every, steps // 20))
        train_cfg = dataclasses.replace(
            train_cfg, max_steps=steps, t_max=steps, warmup_steps=warmup, log_every=log_every
        )
        calibrated = {"steps_per_s": speed, "max_steps": steps}
    if args.time_budget is not None:
        # The budget counts from the command's start: calibration and set-up are part of it.
        left = max(1.0, args.time_budget - (time.perf_counter() - t_start))
        train_cfg = dataclasses.replace(train_cfg, time_budget_s=left)
    if rank == 0:
        shutil.copyfile(meta["tokenizer_path"], run_dir / TOKENIZER_FILE)
        write_json_atomic(
            run_dir / RUN_FILE,
            {
                "data": str(Path(args.data).resolve()),
                "recipe": recipe,
                "model_config": model_cfg.to_dict(),
                "train_config": train_cfg.to_dict(),
                "data_config": dataclasses.asdict(data_cfg),
                "eos_id": meta.get("eos_id"),
                "vocab_size": meta["vocab_size"],
                "bytes_per_token": meta["bytes_per_token"],
                "n_params": n_params(model_cfg),
                "calibration": calibrated,
                "world_size": world_size,
            },
        )
        print(
            f"lmtrain: {n_params(model_cfg) / 1e6:.2f}M parameters ({recipe or 'config file'}), seq_len "
            f"{data_cfg.seq_len}, micro_batch {train_cfg.micro_batch} x accum {train_cfg.grad_accum} x "
            f"{world_size} rank(s), lr {train_cfg.lr:g}, max_steps {train_cfg.max_steps}"
            + (f" (sized to the budget at {calibrated['steps_per_s']:.2f} steps/s)" if calibrated else ""),
            flush=True,
        )
    train_file = tokbin.TokenFile(meta["train_path"])
    val_file = tokbin.TokenFile(meta["val_path"])
    if data_cfg.sampler == "random":
        sampler = tokbin.RandomWindows(train_file.n_tokens, data_cfg.seq_len, train_cfg.micro_batch,
                                       seed=train_cfg.seed, rank=rank, world_size=world_size)  # fmt: skip
    else:
        sampler = tokbin.EpochWindows(train_file.n_tokens, data_cfg.seq_len, train_cfg.micro_batch,
                                      seed=train_cfg.seed, rank=rank, world_size=world_size)  # fmt: skip
    loader = tokbin.Loader(train_file, sampler, max_prefetch=data_cfg.prefetch)
    monitor = _start_monitor(run_dir) if args.gpumon and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    try:
        trainer = Trainer(
            model,
            train_cfg,
            loader,
            run_dir=run_dir,
            eval_data=val_batches(val_file, data_cfg.seq_len, train_cfg.micro_batch),
            bytes_per_token=meta["val"]["bytes_per_token"],
            ds_config=args.deepspeed,
            extra_state={"model_config": model_cfg.to_dict(), "data_config": dataclasses.asdict(data_cfg)},
        )
        summary = trainer.fit(resume=args.resume)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ValueError) and ("ds_config" in str(exc) or "TrainConfig" in str(exc)):
            raise LmtrainError(str(exc)) from exc
        raise
    except RuntimeError as exc:
        if world_size > 1 and _is_comm_failure(exc):
            raise LmtrainError(
                f"rank {rank} of {world_size} lost contact with the other ranks (a node or process died, or the "
                f"network failed): {str(exc).splitlines()[0][:300]}. Restart the job with --resume (torchrun "
                "--max-restarts does this) to continue from the latest checkpoint"
            ) from exc
        raise
    finally:
        loader.close()
        if monitor is not None:
            monitor.__exit__(None, None, None)
            print(f"gpumon ({run_dir / 'gpumon.csv'}):\n{monitor.summary()}", flush=True)
    if rank == 0:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size:
            try:
                plot_metrics(metrics, run_dir / "loss.png")
            except Exception as exc:  # a plot must not fail a finished run
                print(f"lmtrain: could not plot {metrics}: {exc}", file=sys.stderr)
        print(json.dumps({"summary": summary, "run_dir": str(run_dir)}, default=str), flush=True)
    return 0


def _start_monitor(run_dir: Path) -> Any:
    import gpumon

    # GPUs through NVML where there is a driver, else the host (CPU, RSS) with gpumon's one-line warning.
    monitor = gpumon.Monitor(rate_hz=100, out=run_dir / "gpumon.csv", backend="auto")
    monitor.__enter__()
    return monitor


def _is_comm_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    needles = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe", "distbackenderror")
    return any(n in text for n in needles)
