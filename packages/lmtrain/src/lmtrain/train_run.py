"""Training: :func:`train`, the Python API, and `lmtrain train`, its command-line adapter.

An lmcore GPT on tokbin batches through a trainloop Trainer, as :func:`lmtrain.plan.plan_run` planned it. Single
process by default; under torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK in the environment)
every rank runs this same code: each draws its own rows of the global batch and trainloop sets up the process
group. A DeepSpeed JSON config switches the engine to DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.data_check import check_token_data
from lmtrain.errors import LmtrainError
from lmtrain.overrides import parse_pairs
from lmtrain.plan import DataInfo, RunPlan, TrainRequest, Verify, World, plan_run
from lmtrain.run_files import RUN_FILE, TOKENIZER_FILE, read_meta, read_run, write_json_atomic
from lmtrain.run_lock import output_lock

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class RunSummary:
    """How a run ended: why it stopped (None: the planned end), the last step and loss, the final evaluation, the
    best evaluation, the last checkpoint, the tokens trained on, the skipped steps, the wall time, the re-plans of a
    budgeted schedule, and the plan it ran."""

    run_dir: Path
    stopped: str | None
    step: int
    loss: float | None
    eval: Mapping[str, float] | None
    best: Mapping[str, Any] | None
    checkpoint: str
    tokens_seen: int
    total_skips: int
    wall_s: float
    budget_plans: tuple[Mapping[str, Any], ...]
    plan: RunPlan

    def to_dict(self) -> dict[str, Any]:
        """The summary as `lmtrain train` prints it (and RUN_DIR/summary.json holds it)."""
        fields = ("stopped", "loss", "eval", "step", "tokens_seen", "checkpoint", "best", "total_skips", "wall_s")
        return {name: getattr(self, name) for name in fields} | {"budget_plans": list(self.budget_plans)}


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
        >>> from lmtrain.demo import tiny_data
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


def run_request(
    request: TrainRequest, *, quiet: bool = False, t_start: float | None = None, as_json: bool = False
) -> RunSummary:
    """Plan ``request``, then train as planned (see :func:`train`); ``t_start`` is when the command began (setup
    before this call is charged to a time budget). The run ends with a closing block (:func:`closing_block`) and the
    same facts as one JSON line; ``as_json`` prints the JSON line alone."""
    t_start = time.perf_counter() if t_start is None else t_start
    quieted = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with output_lock("train", request.out), quieted:
        return _run(request, t_start, as_json)


def stop_reason(summary: RunSummary) -> str:
    """Why the run ended, in words: the planned end (the time budget's, or the step count's) or what stopped it."""
    if summary.stopped is None:
        planned = summary.plan.train.max_steps
        return "time budget used" if summary.plan.budgeted else f"planned end (max_steps {planned:,})"
    return str(summary.stopped)


def closing_block(summary: RunSummary, command_s: float | None = None) -> str:
    """The end of a run as people read it: why it stopped, steps and tokens, the best checkpoint, the final
    evaluation with units, the wall time, where the weights and the plot are, and the commands that use them."""
    from trainloop.metrics_logging import format_eval

    run_dir = summary.run_dir
    rows = [("stopped", f"{stop_reason(summary)}, at step {summary.step:,}"),
            ("trained", f"{summary.step:,} steps, {summary.tokens_seen:,} tokens"
                        + (f", {summary.total_skips} skipped" if summary.total_skips else ""))]  # fmt: skip
    if summary.loss is not None:
        rows.append(("last loss", f"{summary.loss:.4f} nats/token (training batch)"))
    if summary.eval:
        rows.append(("final eval", format_eval(dict(summary.eval))))
    best_dir = None
    if summary.best:
        best_dir = Path(summary.checkpoint).parent / f"step_{int(summary.best['step']):08d}"
        rows.append(("best", f"step {int(summary.best['step']):,}, eval loss {summary.best['eval_loss']:.4f} "
                             f"nats/token -> {best_dir if best_dir.is_dir() else 'not kept'}"))  # fmt: skip
    rows.append(("weights", f"{summary.checkpoint} (last)"))
    wall = _duration(summary.wall_s) + (f" training, {_duration(command_s)} in all" if command_s is not None else "")
    rows.append(("wall time", wall))
    plot = run_dir / "loss.png"
    rows.append(("plot", str(plot) if plot.is_file() else "none (no metrics)"))
    from lmtrain.demo import lmtrain_command

    command, val_text = lmtrain_command(), Path(summary.plan.meta["val_path"]).parent / "val.txt"
    rows += [("next", f"{command} eval --run {run_dir} --text {val_text}"),
             ("", f"{command} generate --run {run_dir} --prompt TEXT"),
             ("", f"{command} export --run {run_dir} --out DIR")]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(["lmtrain: run finished", *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def _duration(seconds: float) -> str:
    """``75.2`` -> ``'1 min 15 s'``; under a minute, whole seconds; over an hour, hours and minutes."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _run(request: TrainRequest, t_start: float, as_json: bool = False) -> RunSummary:
    import torch

    import lmcore
    import tokbin
    from lmcore import GPT
    from trainloop import BUDGET, CheckpointError, CollectiveError, ConfigError, Trainer
    from trainloop.checkpoint import refuse_outside_links
    from trainloop.distributed import teardown_distributed

    run_dir = Path(request.out)
    try:
        refuse_outside_links(run_dir)  # before anything is written into it
    except CheckpointError as exc:
        raise LmtrainError(str(exc)) from None
    meta = read_meta(request.data_dir)
    train_data = open_train_data(request.blend_spec, meta)
    saved = read_run(run_dir) if request.resume and (run_dir / RUN_FILE).is_file() else None
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    if saved is not None and tokenizer_sha is not None and saved.get("tokenizer_sha256") not in (None, tokenizer_sha):
        # Checked before anything is written: the run's own tokenizer.model is never replaced by another.
        raise LmtrainError(
            f"--data {request.data}: its tokenizer (sha256 {tokenizer_sha}) is not the one {run_dir} was trained "
            f"with (sha256 {saved['tokenizer_sha256']}): resume with that run's data, or start a new run"
        )
    source = None
    if request.init_from is not None and saved is None:
        from lmtrain.init_from import read_init_source

        source = read_init_source(request.init_from, tokenizer_sha, verify=request.verify)
    init = None if source is None else {"model_config": source.model_config, "record": source.record(),
                                        "recipe": source.run.get("recipe")}  # fmt: skip
    info = DataInfo(meta, int(train_data.n_tokens), saved, tokenizer_sha, init)
    world = _world()
    plan = plan_run(request, info, dataclasses.replace(world, elapsed_s=time.perf_counter() - t_start))
    # Before anything trains: headers fit the model, checksums and ids verified once per file (lmtrain.data_check).
    check_token_data([train_data, meta["val_path"]], plan.model.vocab_size, fallback_cache_dir=run_dir)
    while plan.measuring:  # the plan needs step times: measure them on a throw-away model, plan again
        torch.manual_seed(plan.train.seed)
        probe_model = GPT(plan.model)
        shape = (plan.train.micro_batch, plan.seq_len, plan.model.vocab_size)
        if plan.time_threads:
            world = dataclasses.replace(world, step_s=pick_cpu_threads(probe_model, *shape, plan.time_threads))
        else:
            threads = plan.cpu_threads or world.threads_now
            world = dataclasses.replace(world, bf16_step_s=pick_cpu_threads(probe_model, *shape, (threads,),
                                                                            precision="bf16")[threads])  # fmt: skip
        plan = plan_run(request, info, dataclasses.replace(world, elapsed_s=time.perf_counter() - t_start))
    if plan.cpu_threads is not None:
        torch.set_num_threads(plan.cpu_threads)
    matmuls = None
    if not world.cuda:
        matmuls = lmcore.route_cpu_matmuls(plan.model, plan.train.micro_batch * plan.seq_len,
                                           enabled=plan.data.cpu_matmul_probe)  # fmt: skip
    if plan.budgeted and not plan.resumed:
        # A budget is charged with everything before training: planned again with the time that took.
        plan = plan_run(request, info, dataclasses.replace(world, elapsed_s=time.perf_counter() - t_start))
    ds_config = plan.ds_config  # resolved here, once: a value DeepSpeed refuses stops the run before it writes
    torch.manual_seed(plan.train.seed)
    model = GPT(plan.model)
    if source is not None:
        from lmtrain.init_from import load_init_weights

        load_init_weights(model, source)
        source = None  # its copy of the weights is no longer needed
    if request.compile:
        lmcore.compile_model(model)
    rank = world.rank
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for line in plan.lines():
            print(f"lmtrain: {line}", flush=True)
        if matmuls is not None and plan.data.cpu_matmul_probe:
            print(f"lmtrain: fp32 GEMMs on {'oneDNN' if matmuls.routed else 'MKL'}: {matmuls.reason}", flush=True)
    try:
        sampler = _sampler(plan, train_data)
    except ValueError as exc:  # tokbin's one line, e.g. a blend source shorter than a window
        raise LmtrainError(f"--data {request.data}: {exc}") from None
    loader = tokbin.Loader(train_data, sampler, max_prefetch=plan.data.prefetch)
    val_file = tokbin.open_tokens(meta["val_path"])
    eval_data = val_batches(val_file, plan.seq_len, plan.train.micro_batch, rank=rank,
                            world_size=world.world_size, max_windows=plan.eval_windows)  # fmt: skip
    monitor = _start_monitor(run_dir) if request.gpumon and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    schedule: Any = BUDGET.schedule(plan.loop_config, plan.first_guess) if plan.budgeted else None
    if schedule is not None and world.single_cpu_process and plan.cpu_threads is not None and not world.threads_fixed:
        schedule = ThreadCheck(schedule, model, plan, counts=tuple(sorted({1, world.cpu_count})))
    try:
        trainer = Trainer(model, plan.loop_config, loader, run_dir=run_dir, eval_data=eval_data,
                          bytes_per_token=meta["val"]["bytes_per_token"], ds_config=ds_config,
                          extra_state={"model_config": plan.model.to_dict(),
                                       "data_config": dataclasses.asdict(plan.data),
                                       "tokenizer_sha256": plan.tokenizer_sha256},
                          schedule=schedule, on_eval=(lambda *_: _plot(run_dir)) if rank == 0 else None)  # fmt: skip
        out = trainer.fit(resume=request.resume, overwrite=request.overwrite, verify=request.verify,
                          on_ready=lambda: _write_run_files(plan, run_dir) if rank == 0 else None)  # fmt: skip
    except (ConfigError, CheckpointError) as exc:
        raise LmtrainError(str(exc)) from exc
    except CollectiveError as exc:
        raise LmtrainError(
            f"rank {rank} of {world.world_size} lost contact with the other ranks (a node or process died, or the "
            f"network failed): {str(exc).splitlines()[0][:300]}. Restart the job with --resume (torchrun "
            "--max-restarts does this) to continue from the latest checkpoint"
        ) from exc
    finally:
        loader.close()
        teardown_distributed()  # before the interpreter's own teardown, where gloo's threads can abort the process
        if monitor is not None:
            monitor.__exit__(None, None, None)
            print(f"gpumon ({monitor.out}):\n{monitor.summary()}", flush=True)
    plans = tuple(getattr(trainer.schedule, "plans", ()))
    summary = RunSummary(run_dir=run_dir, budget_plans=plans, plan=plan, **out)
    if rank == 0:
        write_json_atomic(run_dir / SUMMARY_FILE, json.loads(json.dumps(summary.to_dict(), default=str)))
        _plot(run_dir)
        if not as_json:
            print(closing_block(summary, time.perf_counter() - t_start), flush=True)
        facts = {"summary": {**summary.to_dict(), "reason": stop_reason(summary)}, "run_dir": str(run_dir)}
        print(json.dumps(facts, default=str), flush=True)
    return summary


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
    overrides = {**values.pop("overrides"), **dict(parse_pairs(args.overrides))}
    if args.gradient_checkpointing:
        overrides["model.checkpointing"] = "block"
    if args.tensorboard:
        overrides["train.tensorboard"] = True
    if args.wandb is not None:
        overrides["train.wandb_project"] = args.wandb
    for key in ("data", "out"):
        if values.get(key) is None:
            where = " (or a `" + key + " = ...` line in --config)" if args.config else ""
            flag = "DATA_DIR" if key == "data" else "RUN_DIR"
            if key == "out" and args.print_config:
                values["out"] = ""  # printed as a line to fill in
                continue
            raise LmtrainError(f"--{key} {flag} is required{where}: the {'prepared data' if key == 'data' else 'run'} "
                               "directory")  # fmt: skip
    return TrainRequest(**values, overrides=overrides, resume=args.resume, overwrite=args.overwrite,
                        verify=args.verify)  # fmt: skip


def draft_plan(request: TrainRequest) -> RunPlan:
    """The plan of ``request`` as far as it can be made without training a step: the configs resolved from the
    recipe, the run file, the overrides and the DeepSpeed JSON (what a time budget sizes at launch is left open)."""
    meta = read_meta(request.data_dir)
    train_data = open_train_data(request.blend_spec, meta)
    run_dir = Path(request.out)
    saved = read_run(run_dir) if request.resume and (run_dir / RUN_FILE).is_file() else None
    import tokbin

    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    return plan_run(request, DataInfo(meta, int(train_data.n_tokens), saved, tokenizer_sha), _world())


# ---------------------------------------------------------------------------------------------------- the pieces
def _world() -> World:
    import torch

    import lmcore
    from trainloop.distributed import env_world

    rank, _, world_size = env_world()
    cuda = torch.cuda.is_available()
    return World(rank=rank, world_size=world_size, cuda=cuda, threads_fixed="OMP_NUM_THREADS" in os.environ,
                 cpu_count=os.cpu_count() or 1, threads_now=torch.get_num_threads(),
                 native_bf16=not cuda and lmcore.cpu_has_native_bf16())  # fmt: skip


def _sampler(plan: RunPlan, train_data: Any) -> Any:
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


def _write_run_files(plan: RunPlan, run_dir: Path) -> None:
    """The run's own files beside its checkpoints: a copy of the tokenizer and run.json. Written once the loop knows
    the directory is this run's (its checkpoint restored, or a fresh start allowed), so that a refused resume or a
    refused fresh start changes nothing."""
    _copy_file(Path(plan.meta["tokenizer_path"]), run_dir / TOKENIZER_FILE)
    write_json_atomic(run_dir / RUN_FILE, plan.to_json())


def _copy_file(source: Path, target: Path) -> None:
    """Copy through a temporary file and a rename, so a kill never leaves half a tokenizer."""
    from trainloop.checkpoint import open_new

    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        with open_new(tmp, "wb") as f:
            f.write(source.read_bytes())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _plot(run_dir: Path) -> None:
    from trainloop import plot_metrics

    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        try:
            plot_metrics(metrics, run_dir / "loss.png")
        except Exception as exc:  # a plot must not fail a finished run
            print(f"lmtrain: could not plot {metrics}: {exc}", file=sys.stderr)


def open_train_data(blend_spec: Path | None, meta: Mapping[str, Any]) -> Any:
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
    tokenizer_sha = tokbin.file_sha256(meta["tokenizer_path"]) if Path(meta["tokenizer_path"]).is_file() else None
    if blend.tokenizer_sha256 not in (None, tokenizer_sha):
        raise LmtrainError(
            f"{blend_spec}: its sources were encoded with a tokenizer of sha256 {blend.tokenizer_sha256}, "
            f"{meta['tokenizer_path']} has sha256 {tokenizer_sha}: encode them with that tokenizer "
            "(`tokbin encode --tokenizer ...`) or put the blend beside the data they were prepared with"
        )
    return blend


def pick_cpu_threads(
    model: Any,
    micro_batch: int,
    seq_len: int,
    vocab_size: int,
    counts: tuple[int, ...] | None = None,
    *,
    precision: str = "fp32",
) -> dict[int, float]:
    """Seconds per training step of this model on the CPU for each thread count of `counts` (by default one
    thread and all cores), timed on a throw-away copy: the best of three steps each, in fp32 or under bf16
    autocast (``precision="bf16"``). The thread count is left at the last one tried."""
    import copy

    import torch

    probe = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-9)
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    timings: dict[int, float] = {}
    for threads in counts or sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(3):  # the first step of each setting pays one-off costs; keep the best
            t0 = time.perf_counter()
            with autocast:
                loss = probe(ids, ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            best = min(best, time.perf_counter() - t0)
        timings[threads] = best
    return timings


class ThreadCheck:
    """A budgeted schedule whose re-plans also re-check the CPU threads: at each one, a step of a throw-away copy of
    the model is timed at every count of ``counts`` (lmcore.time_step, 4 steps each; the training time they take
    is charged to the budget like any other) and the run moves to the fastest when it beats the current count by
    more than 10% (lmcore.choose_threads). The thread count chosen at the start can be wrong a minute later on a
    shared machine, several-fold. Everything else is the wrapped schedule's."""

    def __init__(self, schedule: Any, model: Any, plan: RunPlan, counts: tuple[int, ...]) -> None:
        self.schedule, self.model, self.plan, self.counts = schedule, model, plan, counts

    @property
    def max_steps(self) -> int:
        return self.schedule.max_steps

    @property
    def plans(self) -> list[dict[str, Any]]:
        return self.schedule.plans

    def lr(self, step: int) -> float:
        return self.schedule.lr(step)

    def observe(self, step: int, elapsed_s: float) -> str | None:
        message = self.schedule.observe(step, elapsed_s)
        if message is None or len(self.counts) < 2:
            return message
        return f"{message}; {self.recheck()}"

    def recheck(self) -> str:
        import copy

        import torch

        import lmcore

        probe = copy.deepcopy(self.model)
        optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-9)
        cfg = self.plan.train
        ids = torch.randint(0, self.plan.model.vocab_size, (cfg.micro_batch, self.plan.seq_len))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision == "bf16" else contextlib.nullcontext()

        def step() -> None:
            with autocast:
                loss = probe(ids, ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        current = torch.get_num_threads()
        walls = {n: lmcore.time_step(step, n, steps=3, warmup=1).wall_s for n in self.counts}
        chosen = lmcore.choose_threads(walls, current if current in walls else min(walls, key=walls.__getitem__))
        torch.set_num_threads(chosen)
        measured = ", ".join(f"{n} thread(s) {t:.3f}" for n, t in walls.items())
        return (
            f"threads {current} -> {chosen} (s/step {measured})"
            if chosen != current
            else (f"threads stay {current} (s/step {measured})")
        )

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)


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


def _start_monitor(run_dir: Path) -> Any:
    import warnings

    import gpumon

    # GPUs through NVML where there is a driver, else the host (CPU, RSS) with gpumon's one-line warning. One file
    # per node (its host name in the name) and per process: a restart or another node never overwrites a recording.
    monitor = gpumon.Monitor(rate_hz=100, out=gpumon.recording_path(run_dir), backend="auto")
    with warnings.catch_warnings(record=True) as said:  # gpumon's notices (no driver: the host only) as one line each
        warnings.simplefilter("always")
        monitor.__enter__()
    for notice in said:
        print(f"lmtrain: warning: {notice.message}", file=sys.stderr, flush=True)
    return monitor
