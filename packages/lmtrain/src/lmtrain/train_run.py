"""`lmtrain train`: an lmcore GPT on tokbin batches through a trainloop Trainer.

Single process by default; under torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK in the
environment) every rank runs this same code: each draws its own rows of the global batch and trainloop sets up
the process group. `--deepspeed` switches the engine to DeepSpeed with the given JSON config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lmtrain.data_check import check_token_data
from lmtrain.errors import LmtrainError, OverrideError
from lmtrain.model_setup import check_attention_backend
from lmtrain.overrides import apply_overrides, parse_pairs
from lmtrain.planner import plan_regularisation, training_passes
from lmtrain.recipes import DEFAULT_PRESET, DataConfig, data_recipe, train_recipe
from lmtrain.run_files import RUN_FILE, TOKENIZER_FILE, read_meta, read_run, write_json_atomic


def matching_preset(model_config: Any) -> str | None:
    """The preset with the same layer count, heads and width as `model_config` (its recipe then applies)."""
    from lmcore import PRESETS

    for name, values in PRESETS.items():
        if all(values.get(k) == getattr(model_config, k) for k in ("n_layer", "n_head", "d_model")):
            return name
    return None


def overridden_keys(pairs: list[str]) -> set[str]:
    """The field names that `--set section.field=value` pairs set (the section dropped)."""
    return {key.split(".")[-1] for key, _ in parse_pairs(pairs)}


def build_configs(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[Any, Any, DataConfig, str | None, set[str]]:
    """(ModelConfig, TrainConfig, DataConfig, recipe name, fields set on purpose) from the flags, the data and the
    run's saved configs. The fields set on purpose are those of `--set` and those the `--deepspeed` JSON sets."""
    from lmcore import ModelConfig
    from lmtrain.model_setup import base_model_config
    from trainloop import TrainConfig

    run_json = Path(args.out) / RUN_FILE
    if args.resume and run_json.is_file():
        # A resumed run keeps the configs it started with (a recalibrated schedule would change its future).
        run = read_run(args.out)
        try:
            model_cfg = ModelConfig.from_dict(run["model_config"])
            train_cfg = TrainConfig.from_dict(run["train_config"])
            data_cfg = DataConfig(**run["data_config"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LmtrainError(
                f"{run_json}: the run's saved configs do not load ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): expected the file `lmtrain train` wrote; restore "
                "it, or start the run over with --overwrite"
            ) from None
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
    set_keys = overridden_keys(pairs)
    if getattr(args, "document_attention", False):
        if "document_separator" in set_keys:
            raise LmtrainError("--document-attention and --set document_separator=... both set the separator; use one")
        pairs.insert(0, f"model.document_separator={document_separator_of(meta['train_path'])}")
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
    if args.deepspeed:
        # The DeepSpeed JSON is the user's word like --set: its values replace the recipe's, "auto" takes the run's,
        # and a value that differs from a --set one is an error (all of them in one). The Trainer prints the line
        # saying what was taken; a bad file stops here, before anything is written.
        import torch

        from trainloop import ConfigError, adopt_ds_config

        world = int(os.environ.get("WORLD_SIZE", "1"))
        try:
            adoption = adopt_ds_config(args.deepspeed, configs["train"], world, on_cpu=not torch.cuda.is_available(),
                                       explicit=set_keys, explicit_prefix="--set ")  # fmt: skip
        except ConfigError as exc:
            raise LmtrainError(str(exc)) from None
        configs["train"] = adoption.config
        set_keys |= adoption.fields
    model_cfg, train_cfg, data_cfg = configs["model"], configs["train"], configs["data"]
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise LmtrainError(
            f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {meta['vocab_size']}: token ids would index "
            "past the embedding table"
        )
    if data_cfg.seq_len is None:
        data_cfg = dataclasses.replace(data_cfg, seq_len=model_cfg.context_length)
    return model_cfg, train_cfg, data_cfg, recipe, set_keys


def document_separator_of(token_file: str) -> int:
    """The EOS id that tokbin wrote after each document of `token_file` (what --document-attention uses).

    Example (`tiny_data`: a little of the standard library's source, prepared):
        >>> import tempfile
        >>> import numpy as np
        >>> import tokbin
        >>> from lmtrain.demo import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> document_separator_of(str(tiny_data(work.name) / "train.bin"))
        2
        >>> _ = tokbin.write_tokens(f"{work.name}/no_eos.bin", np.arange(10), vocab_size=400)
        >>> document_separator_of(f"{work.name}/no_eos.bin")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: --document-attention: .../no_eos.bin has no EOS id in its header (encoded ...
        >>> work.cleanup()
    """
    import tokbin

    try:
        eos_id = tokbin.open_tokens(token_file).eos_id
    except tokbin.TokenFileError as exc:
        raise LmtrainError(f"--document-attention: {exc}") from exc
    if eos_id is None or eos_id < 0:
        raise LmtrainError(
            f"--document-attention: {token_file} has no EOS id in its header (encoded without EOS?), so its "
            "documents cannot be told apart; re-encode with EOS or drop the flag"
        )
    return int(eos_id)


def open_train_data(blend_spec: Path | None, meta: dict[str, Any]) -> Any:
    """The training tokens: the prepared split (a token file or a shard directory), or the blend `blend_spec` names,
    whose sources must be encoded with the data directory's tokenizer.

    Example (`tiny_data`'s two splits stand in for two corpora encoded with its tokenizer):
        >>> import json, tempfile
        >>> from lmtrain.demo import tiny_data
        >>> from lmtrain.run_files import read_meta
        >>> work = tempfile.TemporaryDirectory()
        >>> data = tiny_data(work.name)
        >>> meta = read_meta(data)
        >>> open_train_data(None, meta).n_tokens == json.loads((data / "meta.json").read_text())["train"]["tokens"]
        True
        >>> mix = {"sources": [{"path": "train.bin", "weight": 0.7}, {"path": "val.bin", "weight": 0.3}]}
        >>> _ = (data / "mix.json").write_text(json.dumps(mix))
        >>> open_train_data(data / "mix.json", meta)  # doctest: +ELLIPSIS
        Blend(sources[0] (.../train.bin): 0.7, sources[1] (.../val.bin): 0.3; n_tokens=..., vocab_size=400)
        >>> work.cleanup()
    """
    import tokbin

    try:
        if blend_spec is None:
            return tokbin.open_tokens(meta["train_path"])
        blend = tokbin.Blend.from_spec(blend_spec)
    except tokbin.TokenFileError as exc:
        raise LmtrainError(str(exc)) from None
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"])
    if blend.tokenizer_sha256 not in (None, tokenizer_sha):
        raise LmtrainError(
            f"{blend_spec}: its sources were encoded with a tokenizer of sha256 {blend.tokenizer_sha256}, "
            f"{meta['tokenizer_path']} has sha256 {tokenizer_sha}: encode them with that tokenizer "
            "(`tokbin encode --tokenizer ...`) or put the blend beside the data they were prepared with"
        )
    return blend


def pick_cpu_threads(
    model: Any, micro_batch: int, seq_len: int, vocab_size: int, counts: tuple[int, ...] | None = None
) -> tuple[int, dict[int, float]]:
    """The fastest thread count for this model's training step on the CPU, timed on a throw-away copy: of `counts`,
    by default one thread and all cores.

    Returns (threads, seconds per step for each count tried).
    """
    import copy

    import torch

    probe = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-9)
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    timings: dict[int, float] = {}
    for threads in counts or sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(3):  # the first step of each setting pays one-off costs; keep the best
            t0 = time.perf_counter()
            probe(ids, ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            best = min(best, time.perf_counter() - t0)
        timings[threads] = best
    return min(timings, key=timings.get), timings


def val_batches(token_file: Any, seq_len: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                max_windows: int | None = None):  # fmt: skip
    """A zero-argument callable yielding consecutive, non-overlapping (inputs, targets) windows of the val split.

    The first `max_windows` windows (all when None) form the evaluated set, the same for any world size; rank r
    takes windows r, r + world_size, ... of it, so the all-reduced sums equal one process's.
    """
    import numpy as np

    def batches():
        starts = np.arange(0, token_file.n_tokens - seq_len - 1, seq_len, dtype=np.int64)[:max_windows]
        mine = starts[rank::world_size]
        for i in range(0, len(mine), batch_size):
            yield token_file.gather(mine[i : i + batch_size], seq_len)

    return batches


def keep_global_batch(train_cfg: Any, rows: int, world: int, fixed: set[str]) -> tuple[Any, str]:
    """The TrainConfig that keeps a resumed run's global batch of `rows` rows per optimizer step on `world` ranks, by
    changing the accumulation (else the micro batch), and a note saying what was done. Fields in `fixed` (set with
    --set or by the DeepSpeed JSON) are left as they are.

    Example (a run of 16 rows per step, resumed on one rank):
        >>> from trainloop import TrainConfig
        >>> cfg, note = keep_global_batch(TrainConfig(micro_batch=8, grad_accum=1), 16, 1, set())
        >>> cfg.grad_accum, note
        (2, 'grad_accum 1 -> 2 keeps the global batch of 16 rows')
        >>> keep_global_batch(TrainConfig(micro_batch=8, grad_accum=1), 16, 1, {"grad_accum"})[1]  # set by the user
        'micro_batch 8 -> 16 keeps the global batch of 16 rows'
    """
    micro, accum = train_cfg.micro_batch, train_cfg.grad_accum
    if micro * accum * world == rows:
        return train_cfg, f"the global batch stays {rows} rows (micro_batch {micro} x grad_accum {accum})"
    if "grad_accum" not in fixed and rows % (micro * world) == 0:
        new = dataclasses.replace(train_cfg, grad_accum=rows // (micro * world))
        return new, f"grad_accum {accum} -> {new.grad_accum} keeps the global batch of {rows} rows"
    if "micro_batch" not in fixed and rows % (accum * world) == 0:
        new = dataclasses.replace(train_cfg, micro_batch=rows // (accum * world))
        return new, f"micro_batch {micro} -> {new.micro_batch} keeps the global batch of {rows} rows"
    return train_cfg, (
        f"the global batch changes from {rows} to {micro * accum * world} rows ({rows} does not split over "
        f"{world} ranks with the batch settings given); set micro_batch/grad_accum with --set to choose"
    )


BUDGET_EVALS = 12  # evaluations per time-budgeted run
BUDGET_PATIENCE = 3  # a time-budgeted run stops after this many evaluations in a row without a new best


def budget_plan(
    train_cfg: Any, budget_s: float, step_s: float | None, keep: set[str] = frozenset()
) -> tuple[Any, dict[str, Any]]:
    """The TrainConfig of a run sized to `budget_s` seconds, and the BudgetSchedule's keyword arguments.

    About 20 logged points even for short budgets; an evaluation every twelfth of the budget on the configured
    subset of the validation split, the best checkpoint kept and early stopping after three evaluations without a
    new best (unless `early_stopping_patience` is in `keep`, the keys the user set); a first guess of the final
    step (twice what the probe's speed allows) that only sizes the progress bar until the first re-plan.

    Example:
        >>> from trainloop import TrainConfig
        >>> cfg, kwargs = budget_plan(TrainConfig(), 260.0, 0.2)
        >>> cfg.schedule, cfg.eval_every_s, cfg.early_stopping_patience, kwargs
        ('wsd', 21.666666666666668, 3, {'first_guess': 2600})
    """
    log_every = max(1, min(train_cfg.log_every, int(budget_s) // 25))
    patience = train_cfg.early_stopping_patience if "early_stopping_patience" in keep else BUDGET_PATIENCE
    cfg = dataclasses.replace(train_cfg, log_every=log_every, schedule="wsd", eval_every=0, keep_best=True,
                              eval_every_s=budget_s / BUDGET_EVALS, time_budget_s=budget_s,
                              early_stopping_patience=patience)  # fmt: skip
    guess = None if step_s is None else int(2 * budget_s / step_s)
    return cfg, {"first_guess": guess}


def run_train(args: argparse.Namespace) -> int:
    """The `lmtrain train` command."""
    t_start = time.perf_counter()
    import torch

    import tokbin
    from lmcore import GPT, n_params
    from trainloop import CheckpointError, CollectiveError, ConfigError, Trainer, plot_metrics
    from trainloop.budget import BudgetSchedule
    from trainloop.distributed import teardown_distributed

    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # --data is a prepared directory, or a blend spec (JSON) inside one: the directory gives the tokenizer and the
    # validation split, the blend the training data.
    blend_spec = Path(args.data) if Path(args.data).suffix == ".json" else None
    meta = read_meta(blend_spec.parent if blend_spec else args.data)
    model_cfg, train_cfg, data_cfg, recipe, set_keys = build_configs(args, meta)
    train_data = open_train_data(blend_spec, meta)
    # Before anything trains: headers fit the model, checksums and ids verified once per file (lmtrain.data_check).
    check_token_data([train_data, meta["val_path"]], model_cfg.vocab_size, fallback_cache_dir=args.out)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = args.resume and (run_dir / RUN_FILE).is_file()
    # Size the schedule to the budget while training, unless steps or the schedule are set explicitly. A resumed
    # run keeps what it started with (run.json), its plan restored from the checkpoint.
    if resumed:
        budgeted = read_run(args.out).get("schedule") == "budget"
    else:
        budgeted = (
            args.time_budget is not None
            and args.max_steps is None
            and not ({"max_steps", "t_max", "schedule", "wsd_decay_steps"} & set_keys)
        )
    check_attention_backend(model_cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(train_cfg.seed)
    model = GPT(model_cfg)
    step_s = None  # seconds per step, when a probe measured it
    on_cpu = world_size == 1 and not torch.cuda.is_available()
    if data_cfg.cpu_threads is not None:
        torch.set_num_threads(data_cfg.cpu_threads)
    elif on_cpu and "OMP_NUM_THREADS" not in os.environ:
        threads, timings = pick_cpu_threads(model, train_cfg.micro_batch, data_cfg.seq_len, model_cfg.vocab_size)
        torch.set_num_threads(threads)
        step_s = timings[threads]
        print(f"lmtrain: {threads} CPU thread(s) (s/step measured: "
              + ", ".join(f"{n} thread(s) {t:.3f}" for n, t in timings.items()) + ")", flush=True)  # fmt: skip
    if budgeted and not resumed and on_cpu and step_s is None:  # the planner needs the speed: time the threads set
        threads = torch.get_num_threads()
        _, timings = pick_cpu_threads(model, train_cfg.micro_batch, data_cfg.seq_len, model_cfg.vocab_size, (threads,))
        step_s = timings[threads]
    if resumed and (saved_world := int(read_run(args.out).get("world_size", world_size))) != world_size:
        saved = read_run(args.out)["train_config"]
        rows = int(saved["micro_batch"]) * int(saved["grad_accum"]) * saved_world
        train_cfg, note = keep_global_batch(train_cfg, rows, world_size, set_keys)
        if rank == 0:
            print(f"lmtrain: resuming a run of {saved_world} rank(s) on {world_size}: {note}", flush=True)
    schedule_kwargs: dict[str, Any] = {}
    plan: dict[str, Any] | None = None
    if budgeted and not resumed:
        # The budget counts from the command's start: setup and the thread probe are charged to it.
        remaining = max(1.0, args.time_budget - (time.perf_counter() - t_start))
        train_cfg, schedule_kwargs = budget_plan(train_cfg, remaining, step_s, set_keys)
        # What the budget buys against the size of the data decides the regularisation (lmtrain.planner).
        if step_s is None:
            plan = {"note": "no measured step time (GPU or several ranks): regularisation as configured"}
        elif args.model_config:
            plan = {"note": "a --model-config file: regularisation as configured"}
        else:
            rows = train_cfg.micro_batch * train_cfg.grad_accum * world_size
            budget_tokens = rows * data_cfg.seq_len * remaining / step_s
            planned_model, train_cfg, note = plan_regularisation(
                train_data.n_tokens, budget_tokens, model_cfg, train_cfg, keep=set_keys
            )
            plan = {"passes": training_passes(train_data.n_tokens, budget_tokens), "note": note}
            if planned_model != model_cfg:
                model_cfg = planned_model
                torch.manual_seed(train_cfg.seed)
                model = GPT(model_cfg)
        if rank == 0:
            print(f"lmtrain: plan: {plan['note']}", flush=True)
    if rank == 0:
        shutil.copyfile(meta["tokenizer_path"], run_dir / TOKENIZER_FILE)
        if resumed:
            # The world size and the batch split it implies are the run's from now on.
            run = read_run(args.out)
            run.update(world_size=world_size, train_config=train_cfg.to_dict())
            write_json_atomic(run_dir / RUN_FILE, run)
        else:
            write_json_atomic(
                run_dir / RUN_FILE,
                {
                    "data": str(Path(args.data).resolve()),
                    "recipe": recipe,
                    "schedule": "budget" if budgeted else "config",
                    "plan": plan,
                    "model_config": model_cfg.to_dict(),
                    "train_config": train_cfg.to_dict(),
                    "data_config": dataclasses.asdict(data_cfg),
                    "eos_id": meta.get("eos_id"),
                    "vocab_size": meta["vocab_size"],
                    "bytes_per_token": meta["bytes_per_token"],
                    "n_params": n_params(model_cfg),
                    "world_size": world_size,
                    "cpu_threads": torch.get_num_threads(),
                },
            )
        steps = "sized to the budget as it runs" if budgeted else f"max_steps {train_cfg.max_steps}"
        print(
            f"lmtrain: {n_params(model_cfg) / 1e6:.2f}M parameters ({recipe or 'config file'}), seq_len "
            f"{data_cfg.seq_len}, micro_batch {train_cfg.micro_batch} x accum {train_cfg.grad_accum} x "
            f"{world_size} rank(s), lr {train_cfg.lr:g}, {steps}",
            flush=True,
        )
    val_file = tokbin.open_tokens(meta["val_path"])
    if blend_spec is not None:
        if data_cfg.sampler != "random":
            raise LmtrainError(f"--data {blend_spec}: a blend draws its windows at random by weight; drop "
                               f"--set sampler={data_cfg.sampler}")  # fmt: skip
        sampler = train_data.sampler(data_cfg.seq_len, train_cfg.micro_batch, seed=train_cfg.seed, rank=rank,
                                     world_size=world_size)  # fmt: skip
    else:
        sampler_cls = tokbin.RandomWindows if data_cfg.sampler == "random" else tokbin.EpochWindows
        sampler = sampler_cls(train_data.n_tokens, data_cfg.seq_len, train_cfg.micro_batch, seed=train_cfg.seed,
                              rank=rank, world_size=world_size)  # fmt: skip
    loader = tokbin.Loader(train_data, sampler, max_prefetch=data_cfg.prefetch)
    eval_windows = None if train_cfg.eval_batches is None else train_cfg.eval_batches * train_cfg.micro_batch
    eval_data = val_batches(val_file, data_cfg.seq_len, train_cfg.micro_batch, rank=rank, world_size=world_size,
                            max_windows=eval_windows)  # fmt: skip
    # Each rank evaluates its share of the fixed subset above; the loop must not cut it again.
    train_cfg = dataclasses.replace(train_cfg, eval_batches=None)
    monitor = _start_monitor(run_dir) if args.gpumon and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    try:
        trainer = Trainer(
            model,
            train_cfg,
            loader,
            run_dir=run_dir,
            eval_data=eval_data,
            bytes_per_token=meta["val"]["bytes_per_token"],
            ds_config=args.deepspeed,
            extra_state={"model_config": model_cfg.to_dict(), "data_config": dataclasses.asdict(data_cfg)},
            schedule=BudgetSchedule(train_cfg, **schedule_kwargs) if budgeted else None,
        )
        summary = trainer.fit(resume=args.resume, overwrite=args.overwrite, verify=args.verify)
    except (ConfigError, CheckpointError) as exc:
        raise LmtrainError(str(exc)) from exc
    except CollectiveError as exc:
        raise LmtrainError(
            f"rank {rank} of {world_size} lost contact with the other ranks (a node or process died, or the "
            f"network failed): {str(exc).splitlines()[0][:300]}. Restart the job with --resume (torchrun "
            "--max-restarts does this) to continue from the latest checkpoint"
        ) from exc
    finally:
        loader.close()
        teardown_distributed()  # before the interpreter's own teardown, where gloo's threads can abort the process
        if monitor is not None:
            monitor.__exit__(None, None, None)
            print(f"gpumon ({monitor.out}):\n{monitor.summary()}", flush=True)
    if rank == 0:
        if budgeted:
            run = read_run(args.out)
            run["budget_plan"] = trainer.schedule.plans
            write_json_atomic(run_dir / RUN_FILE, run)
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

    # GPUs through NVML where there is a driver, else the host (CPU, RSS) with gpumon's one-line warning. One file
    # per node (its host name in the name) and per process: a restart or another node never overwrites a recording.
    monitor = gpumon.Monitor(rate_hz=100, out=gpumon.recording_path(run_dir), backend="auto")
    monitor.__enter__()
    return monitor
