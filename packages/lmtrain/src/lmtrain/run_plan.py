"""A run's plan, as one value, for every command that trains: what the user asked, the recipe's starting configs,
the run being resumed and the world it runs in, decided before anything trains.

A recipe (`train`'s in lmtrain.plan, `finetune`'s in lmtrain.finetune_run) says where its configs start
(:class:`Base`); :func:`settle` does the rest the same way for every recipe: the user's ``--set`` overrides, the
end of the run (``--max-steps``, a recipe's default number of steps), the DeepSpeed JSON, the time budget, the CPU
threads and precision, the batch re-split of a resume on another number of ranks, and a line for each decision
that was not the user's. It reads the config files the request names and nothing else, and writes nothing. A step
time it needs but the world lacks is asked for in ``RunPlan.time_threads`` / ``time_bf16``: the caller times those
and settles again (lmtrain.scaffold does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lmtrain.errors import LmtrainError, OverrideError
from lmtrain.overrides import apply_overrides, targets
from lmtrain.recipes import DataConfig

Verify = Literal["sizes", "full"]
ENGINES = ("torch", "fsdp", "deepspeed")
# Setting any of these by hand means the user sized the schedule: a time budget then only caps the run.
SCHEDULE_FIELDS = frozenset({"max_steps", "t_max", "schedule", "wsd_decay_steps"})
# A time-budgeted CPU run trains with bf16 autocast instead of fp32 where the CPU multiplies bf16 natively and a
# timed bf16 step is at least this much faster. Quality at equal steps measured unchanged (docs/benchmarks.md,
# "A training step at the machine's limit"): cpu-small, 600 steps of TinyShakespeare, seeds 0-2, whole validation
# split: fp32 2.3518/2.3448/2.3546, bf16 2.3561/2.3405/2.3489 bits/char (differences inside the 0.010 spread between
# seeds); a bf16 step there took 0.66-0.67x an fp32 one with AMX, 1.28-1.32x with AVX512_BF16 kernels alone.
BF16_MIN_SPEEDUP = 1.1
LONG_RUN_S = 86_400.0  # a run planned to outlast a day on the device it found is worth a word before it starts


class RunOptions(Protocol):
    """The flags every command that trains takes (lmtrain.parsers.add_run_flags): both recipes' requests have them."""

    @property
    def out(self) -> str: ...
    @property
    def overrides(self) -> Mapping[str, Any]: ...
    @property
    def time_budget_s(self) -> float | None: ...
    @property
    def max_steps(self) -> int | None: ...
    @property
    def resume(self) -> bool: ...
    @property
    def overwrite(self) -> bool: ...
    @property
    def verify(self) -> Verify: ...
    @property
    def deepspeed(self) -> str | Mapping[str, Any] | None: ...
    @property
    def engine(self) -> str | None: ...
    @property
    def gpumon(self) -> bool: ...
    @property
    def compile(self) -> bool: ...


def check_run_options(request: RunOptions) -> None:
    """The one-line errors of contradictory run flags, for every recipe's request."""
    if request.resume and request.overwrite:
        raise LmtrainError("--resume continues a run and --overwrite deletes it: give one")
    if request.verify not in ("sizes", "full"):
        raise LmtrainError(f"verify={request.verify!r}: expected 'sizes' or 'full'")
    if request.engine not in (None, *ENGINES):
        raise LmtrainError(f"--engine {request.engine}: expected torch, fsdp or deepspeed")
    if request.deepspeed is not None and request.engine not in (None, "deepspeed"):
        raise LmtrainError(
            f"--engine {request.engine} and --deepspeed both name an engine: drop --deepspeed to train with "
            f"{request.engine}, or use --engine deepspeed"
        )
    if request.max_steps is not None and (isinstance(request.max_steps, bool) or request.max_steps < 1):
        raise LmtrainError(f"--max-steps {request.max_steps}: expected a number of optimizer steps >= 1")
    budget = request.time_budget_s
    if budget is not None and not (isinstance(budget, (int, float)) and 0 < budget < float("inf")):
        raise LmtrainError(f"--time-budget {budget} (time_budget_s): expected a finite number of seconds > 0")


@dataclass(frozen=True)
class World:
    """Where the run trains: its ranks and device, whether OMP_NUM_THREADS fixes the CPU threads, the cores, and
    what was measured or recorded of the CPU: the seconds per step for each thread count tried (None before any
    measurement), a thread count and a precision recorded by the run being resumed, its source (--init-from) or
    the machine's probe cache (lmtrain.probes), and the seconds the command has spent, which a budget is charged
    (the probes' own time not included)."""

    rank: int = 0
    world_size: int = 1
    cuda: bool = False
    threads_fixed: bool = False
    cpu_count: int = 1
    threads_now: int = 1
    step_s: Mapping[int, float] | None = None
    native_bf16: bool = False  # the CPU multiplies bf16 in hardware (lmcore.cpu_has_native_bf16)
    bf16_step_s: float | None = None  # seconds per bf16-autocast step at the planned threads, once measured
    elapsed_s: float = 0.0
    recorded_threads: int | None = None  # the thread count to keep (a record or the probe cache), not re-probed
    recorded_precision: str | None = None  # "bf16" or "fp32" as the probe cache decided for this model, or None

    @property
    def single_cpu_process(self) -> bool:
        return self.world_size == 1 and not self.cuda


@dataclass(frozen=True)
class Base:
    """Where a recipe's configs start, before the user's ``--set``: the model, training and data configs, the
    recipe's name, its notes, values set ahead of the user's (``{"model.document_separator": 2}``), and how an
    unbudgeted new run is sized: ``size(train_config, max_steps, fixed)`` (a fine-tune: one epoch unless --max-steps,
    evaluations and checkpoints at quarters) or by default the recipe's own ``max_steps`` (``--max-steps`` then ends the
    decay where the run ends: :func:`size_steps`). ``check(model, train, data)`` refuses, in one LmtrainError, configs
    the recipe cannot run; ``regularise_tokens`` (the training tokens) lets the budget planner set dropout and weight
    decay (lmtrain.planner); ``explicit_config``: the model came from the user's config file."""

    model: Any  # lmcore ModelConfig
    train: Any  # trainloop TrainConfig
    data: DataConfig
    recipe: str | None = None
    notes: tuple[str, ...] = ()
    values: Mapping[str, Any] = field(default_factory=dict)
    size: Callable[[Any, int | None, set[str]], Any] | None = None
    check: Callable[[Any, Any, DataConfig], None] | None = None
    regularise_tokens: int | None = None  # training tokens, for the budget's regularisation (None: none)
    label: str | None = None  # the model in the plan's lines when no recipe names it (a base model's directory)
    explicit_config: bool = False  # a --model-config file: its regularisation is the user's


@dataclass(frozen=True)
class RunPlan:
    """Everything a run is, decided: see the module docstring. ``notes`` holds a line for each decision that was
    not the user's (threads, a re-split batch, the regularisation, what the DeepSpeed JSON set)."""

    request: Any  # the recipe's request (RunOptions)
    recipe: str | None
    model: Any  # lmcore ModelConfig
    train: Any  # trainloop TrainConfig, as run.json records it
    data: DataConfig
    budgeted: bool
    resumed: bool
    fixed: frozenset[str]  # fields the user set (overrides, the DeepSpeed JSON)
    world: World
    cpu_threads: int | None = None  # threads to set before training (None: leave them)
    step_s: float | None = None  # measured seconds per step at cpu_threads
    time_threads: tuple[int, ...] = ()  # thread counts to time before the plan is final
    time_bf16: bool = False  # a bf16-autocast step at cpu_threads to time before the plan is final
    first_guess: int | None = None  # the budgeted schedule's first estimate of the final step
    regularisation: Mapping[str, Any] | None = None  # {"passes": ..., "note": ...} or {"note": ...}
    adoption: Any = None  # trainloop Adoption of the DeepSpeed JSON, for engine="deepspeed"
    notes: tuple[str, ...] = ()
    saved: Any = None  # the RunRecord of the run being resumed
    label: str | None = None  # what the model is when no recipe names it

    @property
    def ds_config(self) -> Any:
        """The DeepSpeed config for ``deepspeed.initialize`` (trainloop's ResolvedDSConfig), None without DeepSpeed:
        resolved on the first call, once; a value DeepSpeed's own parser refuses is one LmtrainError."""
        if self.adoption is None:
            return None
        from trainloop import ConfigError

        try:
            return self.adoption.resolved_for(self.train)
        except ConfigError as exc:
            raise LmtrainError(str(exc)) from None

    @property
    def measuring(self) -> bool:
        """Whether the plan waits for measurements (``time_threads``, ``time_bf16``) before it is final."""
        return bool(self.time_threads or self.time_bf16)

    @property
    def seq_len(self) -> int:
        """The training context (DataConfig.seq_len, resolved to the model's context_length when unset)."""
        return self.data.seq_len if self.data.seq_len is not None else self.model.context_length

    @property
    def eval_windows(self) -> int | None:
        """The validation windows every evaluation scores (the first ones of the split; all when None)."""
        return None if self.train.eval_batches is None else self.train.eval_batches * self.train.micro_batch

    @property
    def loop_config(self) -> Any:
        """The TrainConfig the loop gets: each rank evaluates its share of the fixed windows above, which the loop
        must not cut again."""
        return dataclasses.replace(self.train, eval_batches=None)

    def lines(self) -> list[str]:
        """The command's plan, one line per decision and a last line with the run's size."""
        from lmcore import n_params

        cfg = self.train
        steps = "sized to the budget as it runs" if self.budgeted else f"max_steps {cfg.max_steps}"
        size = (
            f"{n_params(self.model) / 1e6:.2f}M parameters ({self.recipe or self.label or 'config file'}), seq_len "
            f"{self.seq_len}, micro_batch {cfg.micro_batch} x accum {cfg.grad_accum} x {self.world.world_size} "
            f"rank(s), lr {cfg.lr:g}, {steps}"
        )
        return [*self.notes, size]


def saved_base(saved: Any, where: str, asked: str | None) -> Base:
    """The :class:`Base` of a resumed run: the configs its record holds (a recalibrated schedule would change its
    future); ``asked`` names a model the command asked for, which a resumed run ignores with a note."""
    try:
        model, train, data = saved.model(), saved.train(), saved.data_settings()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise LmtrainError(
            f"{where}: the run's saved configs do not load ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): expected the file the run's command wrote; restore "
            "it, or start the run over with --overwrite"
        ) from None
    notes = (f"{asked} ignored: a resumed run keeps the configs it started with (run.json); --overwrite starts it "
             "over",) if asked else ()  # fmt: skip
    return Base(model, train, data, recipe=saved.recipe, notes=notes)


def settle(request: RunOptions, base: Base, world: World, saved: Any = None) -> RunPlan:
    """The plan of ``request`` from ``base`` in ``world`` (see the module docstring); ``saved`` is the RunRecord of
    the run being resumed (its configs are ``base``). A bad request is one LmtrainError naming the value and the
    fix."""
    from trainloop import ConfigError, adopt_ds_config

    notes = list(base.notes)
    resumed = saved is not None
    configs = {"model": base.model, "train": base.train, "data": base.data}
    values = {**base.values, **request.overrides}
    fixed = {name for key in request.overrides for _, name in targets(key, configs)}
    if request.time_budget_s is not None:
        values["train.time_budget_s"] = float(request.time_budget_s)
    if request.deepspeed is not None:
        values["train.engine"] = "deepspeed"
    elif request.engine is not None:
        values["train.engine"] = request.engine
    settled = apply_overrides(values, configs)
    if resumed:
        notes += _changes_to_saved(configs, settled, request.overrides)
    model_cfg, train_cfg, data_cfg = settled["model"], settled["train"], settled["data"]
    if saved is not None:
        budgeted = saved.schedule == "budget"
    else:
        budgeted = request.time_budget_s is not None and request.max_steps is None and not (SCHEDULE_FIELDS & fixed)
    if not budgeted and base.size is not None and not resumed:
        train_cfg = base.size(train_cfg, request.max_steps, fixed)
    elif not budgeted and request.max_steps is not None:
        train_cfg = size_steps(train_cfg, request.max_steps, fixed, flag="--max-steps")
    adoption = None
    if request.deepspeed is not None:
        # The DeepSpeed JSON is the user's word like --set: its values replace the recipe's, "auto" takes the run's,
        # and a value that differs from a --set one is an error (all of them in one).
        source = dict(request.deepspeed) if isinstance(request.deepspeed, Mapping) else request.deepspeed
        try:
            adoption = adopt_ds_config(source, train_cfg, world.world_size, on_cpu=not world.cuda, explicit=fixed,
                                       explicit_prefix="--set ", check=False)  # fmt: skip
        except ConfigError as exc:
            raise LmtrainError(str(exc)) from None
        train_cfg = adoption.config
        fixed |= adoption.fields
    if data_cfg.seq_len is None:
        data_cfg = dataclasses.replace(data_cfg, seq_len=model_cfg.context_length)
    if base.check is not None:
        base.check(model_cfg, train_cfg, data_cfg)
    _check_attention_backend(model_cfg, world)

    cpu_threads, step_s, time_threads = _cpu_threads(data_cfg, world, budgeted, resumed, notes)
    train_cfg, step_s, time_bf16 = _cpu_precision(train_cfg, world, budgeted, resumed, fixed, step_s, notes)
    if saved is not None and saved.world_size != world.world_size:
        before = saved.train_config
        rows = int(before["micro_batch"]) * int(before["grad_accum"]) * saved.world_size
        train_cfg, note = keep_global_batch(train_cfg, rows, world.world_size, fixed)
        notes.append(f"resuming a run of {saved.world_size} rank(s) on {world.world_size}: {note}")

    first_guess: int | None = None
    regularisation: dict[str, Any] | None = None
    if budgeted and not resumed and not time_threads and not time_bf16:
        model_cfg, train_cfg, first_guess, regularisation = _size_to_budget(
            request, base, model_cfg, train_cfg, data_cfg, world, step_s, fixed
        )
        if regularisation is not None:
            notes.append(f"plan: {regularisation['note']}")
    notes += plan_warnings(request, train_cfg, fixed, budgeted, step_s, world, sized=base.size is not None)
    return RunPlan(
        request=request, recipe=base.recipe, model=model_cfg, train=train_cfg, data=data_cfg, budgeted=budgeted,
        resumed=resumed, fixed=frozenset(fixed), world=world, cpu_threads=cpu_threads, step_s=step_s,
        time_threads=time_threads, time_bf16=time_bf16, first_guess=first_guess, regularisation=regularisation,
        adoption=adoption, notes=tuple(notes), saved=saved, label=base.label,
    )  # fmt: skip


def size_steps(train_cfg: Any, steps: int, fixed: set[str] | frozenset[str], flag: str | None = None) -> Any:
    """The TrainConfig of a run of ``steps`` optimizer steps: the decay ends where the run ends unless t_max was set,
    and a warmup longer than the decay shrinks to a tenth of it.

    Example:
        >>> from trainloop import TrainConfig
        >>> cfg = size_steps(TrainConfig(warmup_steps=500, t_max=10_000), 40, set())
        >>> cfg.max_steps, cfg.t_max, cfg.warmup_steps
        (40, 40, 4)
    """
    t_max = train_cfg.t_max if "t_max" in fixed else steps
    warmup = train_cfg.warmup_steps if train_cfg.warmup_steps <= t_max or "warmup_steps" in fixed else t_max // 10
    try:
        return dataclasses.replace(train_cfg, max_steps=steps, t_max=t_max, warmup_steps=warmup)
    except ValueError as exc:
        raise OverrideError(f"{flag or 'max_steps'} {steps}: {exc}") from exc


def _changes_to_saved(before: Mapping[str, Any], after: Mapping[str, Any], overrides: Mapping[str, Any]) -> list[str]:
    """A note for each field a resumed run's --set changes from what the run started with."""
    out = []
    for kind in ("model", "train", "data"):
        old, new = dataclasses.asdict(before[kind]), dataclasses.asdict(after[kind])
        for name in sorted(k for k in new if new[k] != old.get(k)):
            out.append(f"--set changes the resumed run's {kind}.{name}: {old.get(name)!r} -> {new[name]!r}")
    return out if overrides else []


def _cpu_threads(data_cfg: DataConfig, world: World, budgeted: bool, resumed: bool,
                 notes: list[str]) -> tuple[int | None, float | None, tuple[int, ...]]:  # fmt: skip
    """(threads to set, seconds per step there when measured, thread counts still to time): the user's
    ``cpu_threads``, else a recorded count (resumed run, --init-from source, the machine's probe cache), else the
    fastest of one thread and all cores, timed; a budget also needs the step time at the threads it runs with."""
    cpu_threads: int | None = None
    step_s: float | None = None
    time_threads: tuple[int, ...] = ()
    if data_cfg.cpu_threads is not None:
        cpu_threads = data_cfg.cpu_threads
    elif world.single_cpu_process and not world.threads_fixed:
        if world.recorded_threads is not None:
            cpu_threads = world.recorded_threads
            notes.append(f"{cpu_threads} CPU thread(s), as recorded (lmtrain.probes): not probed again")
        elif world.step_s is None:
            time_threads = tuple(sorted({1, world.cpu_count}))
        else:
            cpu_threads = min(world.step_s, key=lambda n: world.step_s[n])  # type: ignore[index]
            notes.append(f"{cpu_threads} CPU thread(s) (s/step measured: "
                         + ", ".join(f"{n} thread(s) {t:.3f}" for n, t in world.step_s.items()) + ")")  # fmt: skip
    threads = cpu_threads or world.threads_now
    if world.step_s is not None and threads in world.step_s:
        step_s = world.step_s[threads]
    if budgeted and not resumed and world.single_cpu_process and step_s is None and not time_threads:
        time_threads = (threads,)
    return cpu_threads, step_s, time_threads


def _cpu_precision(train_cfg: Any, world: World, budgeted: bool, resumed: bool, fixed: set[str],
                   step_s: float | None, notes: list[str]) -> tuple[Any, float | None, bool]:  # fmt: skip
    """(TrainConfig, step time at its precision, whether a bf16 step is still to be timed): a budgeted fp32 run on a
    CPU that multiplies bf16 natively takes bf16 autocast when a timed step is BF16_MIN_SPEEDUP faster, or as the
    machine's probe cache recorded for this model."""
    if not (budgeted and not resumed and world.single_cpu_process and world.native_bf16 and step_s is not None
            and train_cfg.precision == "fp32" and "precision" not in fixed):  # fmt: skip
        return train_cfg, step_s, False
    if world.recorded_precision is not None and world.bf16_step_s is None:
        if world.recorded_precision == "bf16":
            return train_cfg, step_s, True  # the step time at bf16 is still needed for the budget
        notes.append("fp32, as recorded (lmtrain.probes): not probed again")
        return train_cfg, step_s, False
    if world.bf16_step_s is None:
        return train_cfg, step_s, True
    speedup = step_s / world.bf16_step_s
    if world.recorded_precision == "bf16" or (world.recorded_precision is None and speedup >= BF16_MIN_SPEEDUP):
        how = "as recorded (lmtrain.probes)" if world.recorded_precision == "bf16" else "and"
        notes.append(f"bf16 autocast: this CPU multiplies bf16 natively {how} a bf16 step measured {speedup:.2f}x "
                     "faster; equal quality at equal steps measured (lmtrain.run_plan.BF16_MIN_SPEEDUP)")  # fmt: skip
        return dataclasses.replace(train_cfg, precision="bf16"), world.bf16_step_s, False
    notes.append(f"fp32: a bf16-autocast step measured {speedup:.2f}x, under {BF16_MIN_SPEEDUP}x")
    return train_cfg, step_s, False


def _size_to_budget(request: RunOptions, base: Base, model_cfg: Any, train_cfg: Any, data_cfg: DataConfig,
                    world: World, step_s: float | None,
                    fixed: set[str]) -> tuple[Any, Any, int | None, dict[str, Any] | None]:  # fmt: skip
    """The budget sizes the schedule (trainloop.BUDGET) and, for a recipe that trains on token files, the
    regularisation (lmtrain.planner). The budget counts from the command's start: setup is charged to it, the
    probes' time is not."""
    from lmtrain.planner import plan_regularisation, training_passes
    from trainloop import BUDGET

    remaining = max(1.0, float(request.time_budget_s) - world.elapsed_s)  # type: ignore[arg-type]
    train_cfg, first_guess = BUDGET.configure(train_cfg, remaining, step_s, keep=fixed)
    if base.regularise_tokens is None:
        return model_cfg, train_cfg, first_guess, None
    # What the budget buys against the size of the data decides the regularisation (lmtrain.planner).
    if step_s is None:
        return model_cfg, train_cfg, first_guess, {
            "note": "no measured step time (GPU or several ranks): regularisation as configured"}  # fmt: skip
    if base.explicit_config:
        return model_cfg, train_cfg, first_guess, {"note": "a --model-config file: regularisation as configured"}
    rows = train_cfg.micro_batch * train_cfg.grad_accum * world.world_size
    budget_tokens = rows * data_cfg.seq_len * remaining / step_s
    model_cfg, train_cfg, note = plan_regularisation(base.regularise_tokens, budget_tokens, model_cfg, train_cfg,
                                                     keep=fixed)  # fmt: skip
    return model_cfg, train_cfg, first_guess, {"passes": training_passes(base.regularise_tokens, budget_tokens),
                                               "note": note}  # fmt: skip


def plan_warnings(request: RunOptions, train_cfg: Any, fixed: set[str] | frozenset[str], budgeted: bool,
                  step_s: float | None, world: World, *, sized: bool = False) -> list[str]:  # fmt: skip
    """Lines starting ``warning:`` for a plan that is probably not what the user meant: no end given on a CPU (the
    recipe's step count; ``sized``: the recipe sized the run itself, e.g. a fine-tune's epoch), a run that would last
    more than a day at the measured step time, a flat learning rate.

    Example (a CPU run with neither --time-budget nor --max-steps, whose step was timed at 0.9 s):
        >>> from types import SimpleNamespace
        >>> from trainloop import TrainConfig
        >>> request = SimpleNamespace(max_steps=None)
        >>> for line in plan_warnings(request, TrainConfig(max_steps=100_000), set(), False, 0.9, World()):
        ...     print(line[:83])
        warning: no --time-budget or --max-steps: training the recipe's 100,000 steps (give
        warning: 100,000 steps at the measured 0.900 s/step take about 1.0 days on this CPU
        >>> flat = TrainConfig(lr=3e-4, min_lr=3e-4, max_steps=10)
        >>> print(plan_warnings(request, flat, {"max_steps"}, False, None, World())[0][:85])
        warning: the learning rate stays at 0.0003 throughout (min_lr = lr, schedule cosine):
    """
    out = []
    device = "GPU" if world.cuda else "CPU"
    if not budgeted and request.max_steps is None and "max_steps" not in fixed and not world.cuda and not sized:
        out.append(f"warning: no --time-budget or --max-steps: training the recipe's {train_cfg.max_steps:,} steps "
                   "(give one to choose the end)")  # fmt: skip
    if not budgeted and step_s is not None and train_cfg.max_steps * step_s > LONG_RUN_S:
        days = train_cfg.max_steps * step_s / 86_400
        out.append(f"warning: {train_cfg.max_steps:,} steps at the measured {step_s:.3f} s/step take about {days:.1f} "
                   f"days on this {device}; --time-budget SECONDS bounds the run")  # fmt: skip
    if train_cfg.schedule != "constant" and train_cfg.min_lr >= train_cfg.lr:
        out.append(f"warning: the learning rate stays at {train_cfg.lr:g} throughout (min_lr = lr, schedule "
                   f"{train_cfg.schedule}): a flat schedule; --set min_lr=... below lr for a decay, or --set "
                   "schedule=constant to mean it")  # fmt: skip
    return out


def _check_attention_backend(model_cfg: Any, world: World) -> None:
    import torch

    from lmtrain.model_setup import check_attention_backend

    check_attention_backend(model_cfg, torch.device("cuda" if world.cuda else "cpu"))


def keep_global_batch(train_cfg: Any, rows: int, world: int, fixed: set[str] | frozenset[str]) -> tuple[Any, str]:
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
