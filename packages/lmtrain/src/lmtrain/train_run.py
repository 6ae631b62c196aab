"""Pretraining: :func:`train`, the Python API, and `lmtrain train`, its command-line adapter.

An lmcore GPT on tokbin batches: the recipe reads the prepared data (token files, a blend), plans the run
(lmtrain.plan), builds the model (from the recipe, a config file or another run's weights) and its samplers, and
hands them to the scaffold every recipe shares (lmtrain.scaffold: run directory, probes, Trainer, summary). Single
process by default; under torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK in the environment)
every rank runs this same code: each draws its own rows of the global batch and trainloop sets up the process group.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lmtrain.data_check import check_token_data
from lmtrain.errors import LmtrainError
from lmtrain.parsers import run_flag_overrides
from lmtrain.plan import DataInfo, RunPlan, TrainRequest, Verify, plan_run, train_record
from lmtrain.run_files import TOKENIZER_FILE, read_meta
from lmtrain.run_summary import RunSummary
from lmtrain.scaffold import Run, check_host_memory, current_world, finish, fit, open_run, route_matmuls, settle_cpu

__all__ = ["RunSummary", "train"]


def train(
    data: str | os.PathLike,
    out: str | os.PathLike,
    *,
    recipe: str | None = None,
    model_config: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    time_budget_s: float | None = None,
    max_steps: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    verify: Verify = "sizes",
    deepspeed: str | os.PathLike | Mapping[str, Any] | None = None,
    engine: str | None = None,
    document_attention: bool = False,
    gpumon: bool = False,
    compile: bool = False,
    quiet: bool = False,
    init_from: str | None = None,
) -> RunSummary:
    """Train a model on ``data`` (a directory written by :func:`lmtrain.prepare.prepare`, or a blend spec inside
    one) into the run directory ``out``, as `lmtrain train` does; returns how the run ended.

    ``recipe`` names a row of :data:`lmtrain.recipes.RECIPES` (default ``cpu-small``), ``model_config`` a
    ModelConfig JSON file instead. ``overrides`` sets any field of the model, training or data config by name
    (``{"lr": 1e-3, "model.dropout": 0.1}``; a string value is converted with the field's type, as ``--set``
    does). ``time_budget_s`` bounds the training time (without ``max_steps`` the schedule is sized to it as it
    runs); ``resume`` continues from the newest complete checkpoint (``verify="full"`` re-hashes it first),
    ``overwrite`` starts over; ``deepspeed`` (a DeepSpeed JSON file or dict) trains with DeepSpeed;
    ``engine`` is "torch", "fsdp" or "deepspeed" (None: DeepSpeed with a DeepSpeed config, else torch); ``compile``
    compiles the model with ``torch.compile`` (no graph breaks: lmcore.compile_model; on a CPU it measured no faster
    in fp32 and its first compile takes a minute or more, so it is off by default). ``init_from``
    (``RUN[:best|latest|STEP]``, default ``best``) starts from that checkpoint's weights and model config with a fresh
    optimizer and schedule (lmtrain.init_from); the run must share the data's tokenizer. ``quiet`` keeps
    the training log off stdout. Bad input is one :class:`~lmtrain.errors.LmtrainError` naming the value and the fix.

    Example (`tiny_data`: a little of the standard library's source, prepared; 4 steps of the tiny recipe):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> summary = train(tiny_data(work.name), f"{work.name}/run", recipe="tiny", max_steps=4,
        ...                 overrides={"eval_every": 2, "log_every": 1}, quiet=True)
        >>> summary.step, summary.stopped, summary.best["step"] in (2, 4), summary.plan.recipe
        (4, None, True, 'tiny')
        >>> sorted(p.name for p in (summary.run_dir / "checkpoints").glob("step_*"))
        ['step_00000002', 'step_00000004']
        >>> work.cleanup()
    """
    request = TrainRequest(
        data=str(data),
        out=str(out),
        recipe=recipe,
        model_config=None if model_config is None else str(model_config),
        overrides=dict(overrides or {}),
        time_budget_s=time_budget_s,
        max_steps=max_steps,
        resume=resume,
        overwrite=overwrite,
        verify=verify,
        deepspeed=deepspeed if isinstance(deepspeed, Mapping) or deepspeed is None else str(deepspeed),
        engine=engine,
        document_attention=document_attention,
        gpumon=gpumon,
        compile=compile,
        init_from=init_from,
    )
    return run_request(request, quiet=quiet)


def run_request(request: TrainRequest, *, quiet: bool = False, t_start: float | None = None,
                as_json: bool = False) -> RunSummary:  # fmt: skip
    """Plan ``request``, then train as planned (see :func:`train`); ``t_start`` is when the command began (setup
    before this call is charged to a time budget). The run ends with a closing block (lmtrain.run_summary), or with
    its facts as one JSON line (``as_json``)."""
    with open_run("train", request, quiet=quiet, t_start=t_start) as run:
        return _run(run, request, as_json)


def _run(run: Run, request: TrainRequest, as_json: bool) -> RunSummary:
    import torch

    import tokbin
    from lmcore import GPT
    from lmtrain.probes import ProbeCache

    meta = read_meta(request.data_dir)
    train_data = open_train_data(request.blend_spec, meta)
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    saved = run.saved
    if saved is not None and tokenizer_sha is not None and saved.tokenizer_sha256 not in (None, tokenizer_sha):
        # Checked before anything is written: the run's own tokenizer.model is never replaced by another.
        raise LmtrainError(
            f"--data {request.data}: its tokenizer (sha256 {tokenizer_sha}) is not the one {run.run_dir} was trained "
            f"with (sha256 {saved.tokenizer_sha256}): resume with that run's data, or start a new run"
        )
    source = None
    if request.init_from is not None and saved is None:
        from lmtrain.init_from import read_init_source

        source = read_init_source(request.init_from, tokenizer_sha, verify=request.verify)
    init = None if source is None else {"model_config": source.model_config, "record": source.record(),
                                        "recipe": source.run.recipe}  # fmt: skip
    info = DataInfo(meta, int(train_data.n_tokens), saved, tokenizer_sha, init)
    # Before anything trains: headers fit the model, checksums and ids verified once per file (lmtrain.data_check).
    draft = plan_run(request, info, run.world)
    check_host_memory(run, draft)  # before a probe builds the model
    vocab_size = draft.model.vocab_size
    check_token_data([train_data, meta["val_path"]], vocab_size, fallback_cache_dir=run.run_dir)
    recorded, cache = saved or (source.run if source is not None else None), ProbeCache()
    plan = settle_cpu(run, lambda world: plan_run(request, info, world), lambda p: GPT(p.model),
                      recorded=recorded, cache=cache)  # fmt: skip
    matmul = route_matmuls(run, plan, recorded=recorded, cache=cache)
    torch.manual_seed(plan.train.seed)
    model = GPT(plan.model)
    if source is not None:
        from lmtrain.init_from import load_init_weights

        load_init_weights(model, source)
        source = None  # its copy of the weights is no longer needed
    try:
        sampler = sampler_for(plan, train_data)
    except ValueError as exc:  # tokbin's one line, e.g. a blend source shorter than a window
        raise LmtrainError(f"--data {request.data}: {exc}") from None
    loader = tokbin.Loader(train_data, sampler, max_prefetch=plan.data.prefetch)
    eval_data = val_batches(tokbin.open_tokens(meta["val_path"]), plan.seq_len, plan.train.micro_batch,
                            rank=run.world.rank, world_size=run.world.world_size,
                            max_windows=plan.eval_windows)  # fmt: skip
    out = fit(
        run,
        plan,
        model,
        loader,
        eval_data,
        record=train_record(plan, info, matmul),
        files={TOKENIZER_FILE: Path(meta["tokenizer_path"])},
        bytes_per_token=meta["val"]["bytes_per_token"],
    )
    windows = f"the first {plan.eval_windows:,}" if plan.eval_windows is not None else "all"
    scored = f"{windows} windows of {plan.seq_len} tokens of the validation split, as during training"
    nexts = next_commands(run.run_dir, meta) if request.next_commands else []
    return finish(run, plan, out, as_json=as_json, next_commands=nexts, scored=scored)


def next_commands(run_dir: Path, meta: Mapping[str, Any]) -> list[str]:
    """What to run after a pretraining run, as the user's shell reaches this lmtrain (lmtrain.shell)."""
    from lmtrain.shell import export_next, lmtrain_command

    command, run, val_text = lmtrain_command(), shlex.quote(str(run_dir)), Path(meta["val_path"]).parent / "val.txt"
    return [f"{command} eval --run {run} --text {shlex.quote(str(val_text))}",
            f"{command} generate --run {run} --prompt TEXT",
            export_next(command, run, "DIR")]  # fmt: skip


def run_train(args: argparse.Namespace) -> int:
    """The `lmtrain train` command: its flags as a :class:`TrainRequest`, trained by :func:`run_request`."""
    t_start = time.perf_counter()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    request = request_from_args(args)
    if args.print_config:
        from lmtrain.run_config import plan_toml

        sys.stdout.write(plan_toml(draft_plan(request)))
        return 0
    run_request(request, t_start=t_start, as_json=args.json)
    return 0


def request_from_args(args: argparse.Namespace) -> TrainRequest:
    """The TrainRequest of `lmtrain train`'s flags over its ``--config`` run file (lmtrain.run_config)."""
    from lmtrain.run_config import read_run_file

    values: dict[str, Any] = read_run_file(args.config) if args.config else {"overrides": {}}
    flags = {"data": args.data, "out": args.out, "model_config": args.model_config, "time_budget_s": args.time_budget,
             "max_steps": args.max_steps, "deepspeed": args.deepspeed, "engine": args.engine,
             "init_from": args.init_from}  # fmt: skip
    if args.preset is not None or args.model_config is not None:  # a model on the command line replaces the file's
        values.pop("recipe", None)
        values.pop("model_config", None)
    values.update({key: value for key, value in flags.items() if value is not None})
    if args.preset is not None:
        values["recipe"] = args.preset
    for key in ("document_attention", "gpumon", "compile"):
        values[key] = getattr(args, key) or bool(values.get(key, False))
    overrides = {**values.pop("overrides"), **run_flag_overrides(args)}
    for key in ("data", "out"):
        if values.get(key) is None:
            where = " (or a `" + key + " = ...` line in --config)" if args.config else ""
            flag = "DATA_DIR" if key == "data" else "RUN_DIR"
            if args.print_config:
                values[key] = ""  # printed as a line to fill in
                continue
            raise LmtrainError(f"--{key} {flag} is required{where}: the {'prepared data' if key == 'data' else 'run'} "
                               "directory")  # fmt: skip
    return TrainRequest(**values, overrides=overrides, resume=args.resume, overwrite=args.overwrite,
                        verify=args.verify, force=args.force)  # fmt: skip


def draft_plan(request: TrainRequest) -> RunPlan:
    """The plan of ``request`` as far as it can be made without training a step: the configs resolved from the
    recipe, the run file, the overrides and the DeepSpeed JSON (what a time budget sizes at launch is left open)."""
    import tokbin
    from lmtrain.run_record import RUN_FILE, read_run_record

    run_dir = Path(request.out)
    saved = read_run_record(run_dir) if request.resume and (run_dir / RUN_FILE).is_file() else None
    if not request.data:  # --print-config without --data: the recipe's own settings, the vocabulary left open
        if request.document_attention:
            raise LmtrainError("--document-attention reads the separator from the data: give --data")
        from lmtrain.plan import model_config_file
        from lmtrain.recipes import DEFAULT_RECIPE, recipe_named

        config = (model_config_file(request.model_config) if request.model_config
                  else recipe_named(request.recipe or DEFAULT_RECIPE).model_config())  # fmt: skip
        meta = {"vocab_size": config.vocab_size, "train": {}, "val": {}}
        return plan_run(request, DataInfo(meta, 2**62, saved), current_world())
    meta = read_meta(request.data_dir)
    train_data = open_train_data(request.blend_spec, meta)
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    return plan_run(request, DataInfo(meta, int(train_data.n_tokens), saved, tokenizer_sha), current_world())


# ---------------------------------------------------------------------------------------------------- the data
def sampler_for(plan: RunPlan, train_data: Any) -> Any:
    import numpy as np

    import tokbin

    cfg, world = plan.train, plan.world
    if plan.request.blend_spec is not None:
        return train_data.sampler(plan.seq_len, cfg.micro_batch, seed=cfg.seed, rank=world.rank,
                                  world_size=world.world_size)  # fmt: skip
    if plan.data.sampler == "dynamic":
        # The original recipe's per-batch length (256 for short text, 1024 for long at seq_len 1024), tokens per
        # batch constant: micro_batch rows of seq_len, or 4x the rows at seq_len / 4.
        if not hasattr(train_data, "doc_offsets"):
            raise LmtrainError(f"--data {plan.request.data}: --set sampler=dynamic reads one token file's document "
                               "index; this split is a shard directory: prepare without --shard-mb, or use "
                               "--set sampler=random")  # fmt: skip
        buckets = tuple(sorted({max(1, plan.seq_len // 4), plan.seq_len}))
        lengths = tokbin.DocumentLengths(np.asarray(train_data.doc_offsets), buckets=buckets)
        return tokbin.DynamicLength(train_data.n_tokens, cfg.micro_batch * plan.seq_len, lengths, seed=cfg.seed,
                                    rank=world.rank, world_size=world.world_size)  # fmt: skip
    sampler_cls = tokbin.RandomWindows if plan.data.sampler == "random" else tokbin.EpochWindows
    return sampler_cls(train_data.n_tokens, plan.seq_len, cfg.micro_batch, seed=cfg.seed, rank=world.rank,
                       world_size=world.world_size)  # fmt: skip


def open_train_data(blend_spec: Path | None, meta: Mapping[str, Any]) -> Any:
    """The training tokens: the prepared split (a token file or a shard directory), or the blend `blend_spec` names,
    whose sources must be encoded with the data directory's tokenizer.

    Example (`tiny_data`'s two splits stand in for two corpora encoded with its tokenizer):
        >>> import json, tempfile
        >>> from lmtrain.examples import tiny_data
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
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    if blend.tokenizer_sha256 not in (None, tokenizer_sha):
        raise LmtrainError(
            f"{blend_spec}: its sources were encoded with a tokenizer of sha256 {blend.tokenizer_sha256}, "
            f"{meta['tokenizer_path']} has sha256 {tokenizer_sha}: encode them with that tokenizer "
            "(`tokbin encode --tokenizer ...`) or put the blend beside the data they were prepared with"
        )
    return blend


def val_batches(token_file: Any, seq_len: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                max_windows: int | None = None) -> Callable[[], Any]:  # fmt: skip
    """A zero-argument callable yielding consecutive, non-overlapping (inputs, targets) windows of the val split.

    The first `max_windows` windows (all when None) form the evaluated set, the same for any world size; rank r
    takes windows r, r + world_size, ... of it, so the all-reduced sums equal one process's.
    """
    import numpy as np

    def batches():
        # A window needs seq_len + 1 tokens (inputs and the targets one further): starts up to n - seq_len - 1.
        starts = np.arange(0, token_file.n_tokens - seq_len, seq_len, dtype=np.int64)[:max_windows]
        mine = starts[rank::world_size]
        for i in range(0, len(mine), batch_size):
            yield token_file.gather(mine[i : i + batch_size], seq_len)

    return batches
