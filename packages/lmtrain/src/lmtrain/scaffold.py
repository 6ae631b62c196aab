"""The bookkeeping every command that trains shares: the run directory, the plan's probes, the Trainer, the end.

A recipe (lmtrain.train_run: pretraining on token files; lmtrain.finetune_run: fine-tuning on chat samples) is one
short function that reads its data, builds its model and says what trains; for everything else it calls this
module, in order::

    with open_run("finetune", request) as run:           # lock, links refused, the saved record of a resume
        ...the recipe reads and checks its inputs (nothing written yet)...
        plan = settle_cpu(run, plan_for, probe_model)     # the plan, its CPU probes timed and recorded
        ...the recipe builds its model and batches...
        out = fit(run, plan, model, batches, eval_data, record=..., ...)   # Trainer: every engine, every lever
        summary = finish(run, plan, out, next_commands=[...])             # summary.json, plot, closing block

so that a lever added here (an engine, a probe, a monitor) reaches every recipe at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError, in_flags
from lmtrain.json_files import copy_file, write_json_atomic
from lmtrain.probes import ProbeCache, set_matmul_library, shapes
from lmtrain.run_plan import RunOptions, RunPlan, World
from lmtrain.run_record import RUN_FILE, RunRecord, read_run_record, write_run_record
from lmtrain.run_summary import RunSummary, closing_block, stop_reason

SUMMARY_FILE = "summary.json"


@dataclass
class Run:
    """An open run directory: the command, its request, when it began, the record of the run it resumes (None for a
    new run), the world it runs in, and the seconds its probes took (never charged to a time budget)."""

    command: str
    request: RunOptions
    run_dir: Path
    t_start: float
    saved: RunRecord | None
    world: World
    probe_s: float = 0.0

    def elapsed(self) -> float:
        """Seconds the command has spent, its probes left out: what a time budget is charged."""
        return time.perf_counter() - self.t_start - self.probe_s

    def say(self, line: str) -> None:
        """A line of the command's own, on the main rank."""
        if self.world.rank == 0:
            print(f"lmtrain {self.command}: {line}" if self.command != "train" else f"lmtrain: {line}", flush=True)


@contextlib.contextmanager
def open_run(command: str, request: RunOptions, *, quiet: bool = False, t_start: float | None = None) -> Iterator[Run]:
    """Hold ``request.out`` for ``command``: one writer per run directory (lmtrain.run_lock), a directory that links
    outside itself refused before anything is written, and the record of the run a ``--resume`` continues read.
    ``quiet`` keeps the command's output off stdout."""
    from lmtrain.run_lock import output_lock
    from trainloop import CheckpointError
    from trainloop.checkpoint import refuse_outside_links

    t_start = time.perf_counter() if t_start is None else t_start
    if not str(request.out).strip():
        raise LmtrainError("--out '': expected a run directory (an empty path would train into the current one)")
    run_dir = Path(request.out)
    quieted = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with output_lock(command, run_dir), quieted:
        try:
            refuse_outside_links(run_dir)  # before anything is written into it
        except CheckpointError as exc:
            raise LmtrainError(str(exc)) from None
        saved = read_run_record(run_dir) if request.resume and (run_dir / RUN_FILE).is_file() else None
        yield Run(command, request, run_dir, t_start, saved, current_world())


def current_world() -> World:
    """The ranks (RANK/WORLD_SIZE of torchrun or the deepspeed launcher), the device and the CPU of this process."""
    import torch

    import lmcore
    from trainloop.distributed import env_world

    rank, _, world_size = env_world()
    cuda = torch.cuda.is_available()
    return World(rank=rank, world_size=world_size, cuda=cuda, threads_fixed="OMP_NUM_THREADS" in os.environ,
                 cpu_count=os.cpu_count() or 1, threads_now=torch.get_num_threads(),
                 native_bf16=not cuda and lmcore.cpu_has_native_bf16())  # fmt: skip


# ------------------------------------------------------------------------------------------------- the CPU probes
def settle_cpu(
    run: Run,
    plan_for: Callable[[World], RunPlan],
    probe_model: Callable[[RunPlan], Any],
    *,
    recorded: RunRecord | None = None,
    cache: ProbeCache | None = None,
) -> RunPlan:
    """The final plan: ``plan_for(world)`` asked again with each step time it asks for, timed on
    ``probe_model(plan)`` (a throw-away model of the plan's shapes), the thread count then set.

    The thread count and the precision are taken, in order, from the user (``--set cpu_threads``,
    ``OMP_NUM_THREADS``, ``--set precision``), the ``recorded`` run (the one resumed, or the --init-from source), the
    machine's probe cache, and only then from a probe, whose answer the cache keeps (lmtrain.probes). The probes'
    time is not charged to a time budget.
    """
    import torch

    world = dataclasses.replace(run.world, elapsed_s=run.elapsed())
    if world.single_cpu_process and not world.threads_fixed:
        draft = plan_for(world)
        key = shapes(draft.model, draft.train.micro_batch, draft.seq_len)
        threads = recorded.cpu_threads if recorded is not None else None
        if threads is None and cache is not None:
            threads = cache.get("threads", key)
        precision = cache.get("precision", key) if cache is not None and recorded is None else None
        threads = threads if isinstance(threads, int) else None
        precision = precision if precision in ("bf16", "fp32") else None
        world = dataclasses.replace(world, recorded_threads=threads, recorded_precision=precision)
    plan = plan_for(world)
    measured = False
    while plan.measuring:  # the plan needs step times: measure them on a throw-away model, plan again
        t0 = time.perf_counter()
        torch.manual_seed(plan.train.seed)
        model = probe_model(plan)
        shape = (plan.train.micro_batch, plan.seq_len, plan.model.vocab_size)
        if plan.time_threads:
            world = dataclasses.replace(world, step_s=pick_cpu_threads(model, *shape, plan.time_threads))
            measured = measured or len(plan.time_threads) > 1
        else:
            threads = plan.cpu_threads or world.threads_now
            bf16 = pick_cpu_threads(model, *shape, (threads,), precision="bf16")[threads]
            world = dataclasses.replace(world, bf16_step_s=bf16)
        del model
        run.probe_s += time.perf_counter() - t0
        plan = plan_for(dataclasses.replace(world, elapsed_s=run.elapsed()))
    if cache is not None and world.single_cpu_process:
        key = shapes(plan.model, plan.train.micro_batch, plan.seq_len)
        if measured and plan.cpu_threads is not None:
            cache.put("threads", key, plan.cpu_threads)
        if world.bf16_step_s is not None:
            cache.put("precision", key, plan.train.precision)
    if plan.cpu_threads is not None:
        torch.set_num_threads(plan.cpu_threads)
    return plan


def route_matmuls(run: Run, plan: RunPlan, *, recorded: RunRecord | None = None,
                  cache: ProbeCache | None = None) -> str | None:  # fmt: skip
    """The library of this run's fp32 GEMMs on a CPU (lmtrain.probes.set_matmul_library), said on the main rank;
    None on a GPU. Several CPU ranks keep MKL, so that every rank computes alike without a probe each."""
    if run.world.cuda:
        return None
    tokens = plan.train.micro_batch * plan.seq_len
    enabled = plan.data.cpu_matmul_probe and run.world.world_size == 1
    library, line = set_matmul_library(plan.model, tokens, enabled=enabled,
                                       recorded=recorded.cpu_matmul if recorded is not None else None,
                                       cache=cache)  # fmt: skip
    if plan.data.cpu_matmul_probe and run.world.world_size > 1:
        line = f"fp32 GEMMs on MKL on each of the {run.world.world_size} CPU ranks (no per-rank probe)"
    run.say(line)
    return library


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
    optimizer = torch.optim.AdamW([p for p in probe.parameters() if p.requires_grad], lr=1e-9)
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


def check_host_memory(run: Run, plan: RunPlan, trainable: int | None = None, frozen: int = 0) -> None:
    """Refuse, before the model is built, a CPU run whose training state would not fit in the host's available
    memory: fp32 weights, gradients and AdamW's two moments (16 bytes per trainable parameter, ``trainable``, by
    default the whole model) and fp32 frozen weights (4 bytes per ``frozen`` parameter). A config asking for 400
    layers at width 16384, or a LoRA rank of a million, otherwise takes the machine's memory until the kernel kills
    the process. ``--force`` goes anyway; a GPU run is left to the estimator (lmcore.memory, `lmtrain doctor`)."""
    import psutil

    from lmcore import n_params

    if run.world.cuda or getattr(run.request, "force", False):
        return
    trainable = n_params(plan.model) if trainable is None else trainable
    need = 16 * trainable + 4 * frozen
    available = psutil.virtual_memory().available // max(1, run.world.world_size)  # ranks share the host
    if need > available:
        raise LmtrainError(
            f"the run's training state needs about {need / 2**30:,.1f} GiB of host memory ({trainable:,} trainable "
            f"parameters at 16 bytes{f', {frozen:,} frozen at 4' if frozen else ''}), {available / 2**30:,.1f} GiB is "
            "available per rank: train a smaller model (or a lower LoRA rank), or add --force to try anyway"
        )


# ------------------------------------------------------------------------------------------------- training
def fit(
    run: Run,
    plan: RunPlan,
    model: Any,
    train_data: Any,
    eval_data: Callable[[], Any] | None,
    *,
    record: RunRecord,
    files: Mapping[str, Path],
    extra_state: Mapping[str, Any] | None = None,
    bytes_per_token: float | None = None,
    after: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Train ``model`` as ``plan`` says, on any engine, and return the Trainer's summary (trainloop.Trainer.fit).

    Once the loop knows the directory is this run's (its checkpoint restored, or a fresh start allowed), the main rank
    writes the run's own files: ``record`` (run.json) and a copy of each of ``files`` (``{name in the run: source}``,
    the tokenizer); a refused resume or a refused fresh start changes nothing. The plan's lines are printed first;
    ``--compile``, ``--gpumon``, the time budget's schedule and the live loss plot apply to every recipe.
    ``after(model)`` runs on every rank once the loop ends (a collective such as gathering sharded adapters may happen
    there); what it returns is in the summary's ``"after"``. Failures of the loop become one LmtrainError.
    """
    import lmcore
    from trainloop import BUDGET, CheckpointError, CollectiveError, ConfigError, Trainer
    from trainloop.distributed import teardown_distributed

    rank, run_dir = run.world.rank, run.run_dir
    if run.request.compile:
        lmcore.compile_model(model)
    run_dir.mkdir(parents=True, exist_ok=True)
    for line in plan.lines():
        run.say(line)
    monitor = _start_monitor(run_dir) if run.request.gpumon and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    schedule: Any = BUDGET.schedule(plan.loop_config, plan.first_guess) if plan.budgeted else None
    state = {"model_config": plan.model.to_dict(), "data_config": dataclasses.asdict(plan.data),
             "tokenizer_sha256": record.tokenizer_sha256, **(extra_state or {})}  # fmt: skip

    def on_ready() -> None:
        if rank == 0:
            for name, source in files.items():
                copy_file(source, run_dir / name)
            write_run_record(run_dir, record)

    try:
        trainer = Trainer(model, plan.loop_config, train_data, run_dir=run_dir, eval_data=eval_data,
                          bytes_per_token=bytes_per_token, ds_config=plan.ds_config, extra_state=state,
                          schedule=schedule, on_eval=(lambda *_: plot(run_dir)) if rank == 0 else None)  # fmt: skip
        out = trainer.fit(resume=run.request.resume, overwrite=run.request.overwrite, verify=run.request.verify,
                          on_ready=on_ready)  # fmt: skip
        if after is not None:
            out["after"] = after(model)
    except (ConfigError, CheckpointError) as exc:
        raise LmtrainError(in_flags(str(exc))) from exc
    except CollectiveError as exc:
        raise LmtrainError(
            f"rank {rank} of {run.world.world_size} lost contact with the other ranks (a node or process died, or the "
            f"network failed): {str(exc).splitlines()[0][:300]}. Restart the job with --resume (torchrun "
            "--max-restarts does this) to continue from the latest checkpoint"
        ) from exc
    finally:
        close = getattr(train_data, "close", None)
        if close is not None:
            close()
        teardown_distributed()  # before the interpreter's own teardown, where gloo's threads can abort the process
        if monitor is not None:
            monitor.__exit__(None, None, None)
            print(f"gpumon ({monitor.out}):\n{monitor.summary()}", flush=True)
    out["budget_plans"] = tuple(getattr(trainer.schedule, "plans", ()))
    return out


def finish(run: Run, plan: RunPlan, out: Mapping[str, Any], *, next_commands: Sequence[str] = (), scored: str = "",
           as_json: bool = False) -> RunSummary:  # fmt: skip
    """The end of a run on the main rank: RUN_DIR/summary.json, the loss plot, and the closing block
    (lmtrain.run_summary) with what the evaluation ``scored`` and ``next_commands``, or with ``as_json`` the same
    facts as one JSON line."""
    fields = {k: out[k] for k in ("stopped", "step", "loss", "eval", "best", "checkpoint", "tokens_seen",
                                  "total_skips", "wall_s", "budget_plans")}  # fmt: skip
    summary = RunSummary(run_dir=run.run_dir, plan=plan, **fields)
    if run.world.rank == 0:
        write_json_atomic(run.run_dir / SUMMARY_FILE, json.loads(json.dumps(summary.to_dict(), default=str)))
        plot(run.run_dir)
        if as_json:
            facts = {"summary": {**summary.to_dict(), "reason": stop_reason(summary)}, "run_dir": str(run.run_dir)}
            print(json.dumps(facts, default=str), flush=True)
        else:
            print(closing_block(summary, next_commands, time.perf_counter() - run.t_start, scored), flush=True)
    return summary


# ------------------------------------------------------------------------------------------------- the pieces
def plot(run_dir: Path) -> None:
    """RUN_DIR/loss.png from RUN_DIR/metrics.jsonl; a plot that fails is a warning, never a failed run, and an
    evaluation before the first logged step has nothing to draw yet."""
    from trainloop import plot_metrics

    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        try:
            plot_metrics(metrics, run_dir / "loss.png")
        except ValueError as exc:
            if not str(exc).endswith("no training records to plot"):
                print(f"lmtrain: could not plot {metrics}: {exc}", file=sys.stderr)
        except Exception as exc:  # a plot must not fail a finished run
            print(f"lmtrain: could not plot {metrics}: {exc}", file=sys.stderr)


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
