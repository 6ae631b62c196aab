"""A training run's plan, as one value: what the user asked, what is on disk and the world it runs in, decided before
anything trains.

:func:`plan_run` turns a :class:`TrainRequest` (the recipe, a model config file, overrides, the DeepSpeed JSON, the
budget), a :class:`DataInfo` (the prepared data, the run being resumed) and a :class:`World` (ranks, device, the
measured step time) into a frozen :class:`RunPlan`: the model, training and data configs, whether the schedule is
sized to a time budget, the batch re-split of a resume on another number of ranks, the regularisation the budget
calls for, the resolved DeepSpeed config, and a line for each decision that was not the user's. It reads the config
files the request names and nothing else, and writes nothing. A step time it needs but the world lacks is asked
for in ``RunPlan.time_threads``: the caller times those thread counts and plans again. ``run.json`` is
:meth:`RunPlan.to_json`; printing :meth:`RunPlan.lines` is the command's plan.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmtrain.errors import LmtrainError, OverrideError
from lmtrain.overrides import apply_overrides, targets
from lmtrain.planner import plan_regularisation, training_passes
from lmtrain.recipes import DEFAULT_RECIPE, RECIPES, DataConfig, recipe_matching, recipe_named

Verify = Literal["sizes", "full"]
# Setting any of these by hand means the user sized the schedule: a time budget then only caps the run.
SCHEDULE_FIELDS = frozenset({"max_steps", "t_max", "schedule", "wsd_decay_steps"})
# A time-budgeted CPU run trains with bf16 autocast instead of fp32 where the CPU multiplies bf16 natively and a
# timed bf16 step is at least this much faster. Quality at equal steps measured unchanged (docs/benchmarks.md,
# "A training step at the machine's limit"): cpu-small, 600 steps of TinyShakespeare, seeds 0-2, whole validation
# split: fp32 2.3518/2.3448/2.3546, bf16 2.3561/2.3405/2.3489 bits/char (differences inside the 0.010 spread between
# seeds); a bf16 step there took 0.66-0.67x an fp32 one with AMX, 1.28-1.32x with AVX512_BF16 kernels alone.
BF16_MIN_SPEEDUP = 1.1


@dataclass(frozen=True)
class TrainRequest:
    """What the user asked for: the flags of `lmtrain train`, or the arguments of :func:`lmtrain.train`.

    ``overrides`` maps field names (``"lr"``, or ``"model.dropout"``, ``"train.seed"``, ``"data.seq_len"`` where a
    name is in several configs) to values; a string value is converted with the field's type, as ``--set`` does.
    ``recipe`` names a row of :data:`lmtrain.recipes.RECIPES` (default ``cpu-small``); ``model_config`` is a
    ModelConfig JSON file instead (a file with a recipe's shape trains with that recipe's settings).
    """

    data: str  # a prepared data directory, or a blend spec (.json) inside one
    out: str
    recipe: str | None = None
    model_config: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    time_budget_s: float | None = None
    max_steps: int | None = None
    resume: bool = False
    overwrite: bool = False
    verify: Verify = "sizes"
    deepspeed: str | Mapping[str, Any] | None = None  # a DeepSpeed JSON config (file or dict): engine="deepspeed"
    engine: str | None = None  # "torch", "fsdp" or "deepspeed"; None: "deepspeed" with a DeepSpeed config, else torch
    document_attention: bool = False
    gpumon: bool = False
    compile: bool = False  # torch.compile the model (lmcore.compile_model); on a CPU it measured no faster in fp32
    init_from: str | None = None  # RUN[:best|latest|STEP]: start from that checkpoint's weights (lmtrain.init_from)

    def __post_init__(self) -> None:
        if self.recipe is not None and self.model_config is not None:
            raise LmtrainError("give a recipe (--preset) or a model config file (--model-config), not both")
        if self.init_from is not None and self.model_config is not None:
            raise LmtrainError("--init-from takes the model config of the run it starts from: drop --model-config")
        if self.resume and self.overwrite:
            raise LmtrainError("--resume continues a run and --overwrite deletes it: give one")
        if self.verify not in ("sizes", "full"):
            raise LmtrainError(f"verify={self.verify!r}: expected 'sizes' or 'full'")
        if self.engine not in (None, "torch", "fsdp", "deepspeed"):
            raise LmtrainError(f"--engine {self.engine}: expected torch, fsdp or deepspeed")
        if self.deepspeed is not None and self.engine not in (None, "deepspeed"):
            raise LmtrainError(
                f"--engine {self.engine} and --deepspeed both name an engine: drop --deepspeed to train with "
                f"{self.engine}, or use --engine deepspeed"
            )

    @property
    def blend_spec(self) -> Path | None:
        """The blend spec --data names, or None for a data directory."""
        return Path(self.data) if Path(self.data).suffix == ".json" else None

    @property
    def data_dir(self) -> Path:
        return self.blend_spec.parent if self.blend_spec else Path(self.data)


@dataclass(frozen=True)
class DataInfo:
    """What is on disk: the data directory's meta.json (:func:`lmtrain.run_files.read_meta`), the number of training
    tokens, the run.json of the run being resumed (None for a new run) and the tokenizer's SHA-256."""

    meta: Mapping[str, Any]
    train_tokens: int
    saved_run: Mapping[str, Any] | None = None
    tokenizer_sha256: str | None = None  # of the data directory's tokenizer.model
    init_from: Mapping[str, Any] | None = None  # {"model_config": ..., "record": ...} of the run --init-from names


@dataclass(frozen=True)
class World:
    """Where the run trains: its ranks and device, whether OMP_NUM_THREADS fixes the CPU threads, the cores, the
    seconds per step measured for each thread count tried (None before any measurement) and the seconds the command
    has already spent, which a time budget is charged."""

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

    @property
    def single_cpu_process(self) -> bool:
        return self.world_size == 1 and not self.cuda


@dataclass(frozen=True)
class RunPlan:
    """Everything a run is, decided: see the module docstring. ``notes`` holds a line for each decision that was
    not the user's (threads, a re-split batch, the regularisation, what the DeepSpeed JSON set)."""

    request: TrainRequest
    meta: Mapping[str, Any]  # the data directory's meta.json, paths resolved (lmtrain.run_files.read_meta)
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
    tokenizer_sha256: str | None = None  # recorded in run.json and with the weights of every checkpoint
    notes: tuple[str, ...] = ()
    saved_run: Mapping[str, Any] | None = None
    init_from: Mapping[str, Any] | None = None  # where the starting weights came from (InitSource.record)

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

    def to_json(self) -> dict[str, Any]:
        """run.json: the plan as the other commands read it back."""
        from lmcore import n_params

        if self.resumed and self.saved_run is not None:
            # A resumed run keeps what it started with; the world size and the batch split it implies are new.
            return {**self.saved_run, "world_size": self.world.world_size, "train_config": self.train.to_dict(),
                    "notes": list(self.notes)}  # fmt: skip
        meta = self.meta
        return {
            "data": str(Path(self.request.data).resolve()),
            "recipe": self.recipe,
            "schedule": "budget" if self.budgeted else "config",
            "plan": dict(self.regularisation) if self.regularisation is not None else None,
            "model_config": self.model.to_dict(),
            "train_config": self.train.to_dict(),
            "data_config": dataclasses.asdict(self.data),
            "eos_id": meta.get("eos_id"),
            "vocab_size": meta["vocab_size"],
            "bytes_per_token": meta["bytes_per_token"],
            "n_params": n_params(self.model),
            "tokenizer_sha256": self.tokenizer_sha256,
            "world_size": self.world.world_size,
            "cpu_threads": self.cpu_threads if self.cpu_threads is not None else self.world.threads_now,
            "notes": list(self.notes),
        } | ({"init_from": dict(self.init_from)} if self.init_from is not None else {})

    def lines(self) -> list[str]:
        """The command's plan, one line per decision and a last line with the run's size."""
        from lmcore import n_params

        cfg = self.train
        steps = "sized to the budget as it runs" if self.budgeted else f"max_steps {cfg.max_steps}"
        size = (
            f"{n_params(self.model) / 1e6:.2f}M parameters ({self.recipe or 'config file'}), seq_len "
            f"{self.data.seq_len}, micro_batch {cfg.micro_batch} x accum {cfg.grad_accum} x {self.world.world_size} "
            f"rank(s), lr {cfg.lr:g}, {steps}"
        )
        return [*self.notes, size]


def plan_run(request: TrainRequest, data: DataInfo, world: World) -> RunPlan:
    """The plan of ``request`` on ``data`` in ``world`` (see the module docstring); a bad request is one
    LmtrainError naming the value and the fix.

    Example (a tiny data directory and a run sized to 60 s on one CPU process whose step was timed at 0.05 s):
        >>> import tempfile
        >>> from lmtrain.demo import tiny_data
        >>> from lmtrain.run_files import read_meta
        >>> work = tempfile.TemporaryDirectory()
        >>> meta = read_meta(tiny_data(work.name))
        >>> request = TrainRequest(data=f"{work.name}/data", out=f"{work.name}/run", recipe="tiny", time_budget_s=60)
        >>> info = DataInfo(meta, train_tokens=meta["train"]["tokens"])
        >>> draft = plan_run(request, info, World(cpu_count=2))
        >>> draft.time_threads  # the budget needs the speed: time one thread and both cores
        (1, 2)
        >>> plan = plan_run(request, info, World(cpu_count=2, step_s={1: 0.05, 2: 0.08}))
        >>> plan.budgeted, plan.cpu_threads, plan.train.schedule, plan.train.time_budget_s
        (True, 1, 'wsd', 60.0)
        >>> print(plan.lines()[0])
        1 CPU thread(s) (s/step measured: 1 thread(s) 0.050, 2 thread(s) 0.080)
        >>> work.cleanup()
    """
    from trainloop import BUDGET, ConfigError, adopt_ds_config

    meta = data.meta
    notes: list[str] = []
    saved = data.saved_run if request.resume else None
    resumed = saved is not None
    model_cfg, train_cfg, data_cfg, recipe = _base_configs(request, meta, saved, notes)
    init = data.init_from if saved is None else None
    if init is not None:
        from lmcore import ModelConfig

        # The weights fix the shape: the source run's model config; the training and data settings of --preset, or
        # else of the source run's recipe.
        model_cfg = ModelConfig.from_dict(dict(init["model_config"]))
        if request.recipe is None and init.get("recipe") in RECIPES:
            recipe = str(init["recipe"])
            train_cfg, data_cfg = RECIPES[recipe].train_config(), RECIPES[recipe].data_config()
        notes.append(f"weights from {init['record']['run']} ({init['record']['checkpoint']}): its model config, a "
                     "fresh optimizer and schedule")  # fmt: skip
    values = dict(request.overrides)
    configs = {"model": model_cfg, "train": train_cfg, "data": data_cfg}
    fixed = {name for key in values for _, name in targets(key, configs)}
    if request.document_attention:
        if "document_separator" in fixed:
            raise LmtrainError("--document-attention and --set document_separator=... both set the separator; use one")
        values = {"model.document_separator": _document_separator(meta), **values}
    if request.time_budget_s is not None:
        values["train.time_budget_s"] = float(request.time_budget_s)
    if request.deepspeed is not None:
        values["train.engine"] = "deepspeed"
    elif request.engine is not None:
        values["train.engine"] = request.engine
    configs = apply_overrides(values, configs)
    model_cfg, train_cfg, data_cfg = configs["model"], configs["train"], configs["data"]
    if request.max_steps is not None:
        # The decay ends where the run ends, unless t_max is set explicitly; a warmup longer than the run shrinks.
        t_max = train_cfg.t_max if "t_max" in fixed else request.max_steps
        warmup = train_cfg.warmup_steps if train_cfg.warmup_steps <= t_max else t_max // 10
        try:
            train_cfg = dataclasses.replace(train_cfg, max_steps=request.max_steps, t_max=t_max, warmup_steps=warmup)
        except ValueError as exc:
            raise OverrideError(f"--max-steps {request.max_steps}: {exc}") from exc
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
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise LmtrainError(
            f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {meta['vocab_size']}: token ids would index "
            "past the embedding table"
        )
    if data_cfg.seq_len is None:
        data_cfg = dataclasses.replace(data_cfg, seq_len=model_cfg.context_length)
    _check_token_counts(request, meta, data, data_cfg.seq_len)
    if request.blend_spec is not None and data_cfg.sampler != "random":
        raise LmtrainError(f"--data {request.blend_spec}: a blend draws its windows at random by weight; drop "
                           f"--set sampler={data_cfg.sampler}")  # fmt: skip
    _check_attention_backend(model_cfg, world)

    # Size the schedule to the budget while training, unless steps or the schedule are set by hand. A resumed run
    # keeps what it started with, its plan restored from the checkpoint.
    if saved is not None:
        budgeted = saved.get("schedule") == "budget"
    else:
        budgeted = request.time_budget_s is not None and request.max_steps is None and not (SCHEDULE_FIELDS & fixed)

    # CPU threads: set, or the fastest measured; a budget also needs the step time at the threads it runs with.
    cpu_threads = step_s = None
    time_threads: tuple[int, ...] = ()
    if data_cfg.cpu_threads is not None:
        cpu_threads = data_cfg.cpu_threads
    elif world.single_cpu_process and not world.threads_fixed:
        counts = tuple(sorted({1, world.cpu_count}))
        if world.step_s is None:
            time_threads = counts
        else:
            cpu_threads = min(world.step_s, key=lambda n: world.step_s[n])  # type: ignore[index]
            step_s = world.step_s[cpu_threads]
            notes.append(f"{cpu_threads} CPU thread(s) (s/step measured: "
                         + ", ".join(f"{n} thread(s) {t:.3f}" for n, t in world.step_s.items()) + ")")  # fmt: skip
    if budgeted and not resumed and world.single_cpu_process and step_s is None and not time_threads:
        threads = cpu_threads or world.threads_now
        if world.step_s is None or threads not in world.step_s:
            time_threads = (threads,)
        else:
            step_s = world.step_s[threads]

    time_bf16 = False
    if (budgeted and saved is None and world.single_cpu_process and world.native_bf16 and step_s is not None
            and train_cfg.precision == "fp32" and "precision" not in fixed):  # fmt: skip
        if world.bf16_step_s is None:
            time_bf16 = True
        elif (speedup := step_s / world.bf16_step_s) >= BF16_MIN_SPEEDUP:
            train_cfg = dataclasses.replace(train_cfg, precision="bf16")
            step_s = world.bf16_step_s
            notes.append(f"bf16 autocast: this CPU multiplies bf16 natively and a bf16 step measured {speedup:.2f}x "
                         "faster; equal quality at equal steps measured (lmtrain.plan.BF16_MIN_SPEEDUP)")  # fmt: skip
        else:
            notes.append(f"fp32: a bf16-autocast step measured {speedup:.2f}x, under {BF16_MIN_SPEEDUP}x")

    if saved is not None and (saved_world := int(saved.get("world_size", world.world_size))) != world.world_size:
        before = saved["train_config"]
        rows = int(before["micro_batch"]) * int(before["grad_accum"]) * saved_world
        train_cfg, note = keep_global_batch(train_cfg, rows, world.world_size, fixed)
        notes.append(f"resuming a run of {saved_world} rank(s) on {world.world_size}: {note}")

    first_guess: int | None = None
    regularisation: dict[str, Any] | None = None
    if budgeted and not resumed and not time_threads and not time_bf16:
        # The budget counts from the command's start: setup and the thread probe are charged to it.
        remaining = max(1.0, request.time_budget_s - world.elapsed_s)  # type: ignore[operator]
        train_cfg, first_guess = BUDGET.configure(train_cfg, remaining, step_s, keep=fixed)
        # What the budget buys against the size of the data decides the regularisation (lmtrain.planner).
        if step_s is None:
            regularisation = {"note": "no measured step time (GPU or several ranks): regularisation as configured"}
        elif request.model_config:
            regularisation = {"note": "a --model-config file: regularisation as configured"}
        else:
            rows = train_cfg.micro_batch * train_cfg.grad_accum * world.world_size
            budget_tokens = rows * data_cfg.seq_len * remaining / step_s
            model_cfg, train_cfg, note = plan_regularisation(data.train_tokens, budget_tokens, model_cfg, train_cfg,
                                                             keep=fixed)  # fmt: skip
            regularisation = {"passes": training_passes(data.train_tokens, budget_tokens), "note": note}
        notes.append(f"plan: {regularisation['note']}")

    if not time_threads and not time_bf16:
        notes += plan_warnings(request, train_cfg, fixed, budgeted, step_s, world)

    return RunPlan(
        request=request, meta=meta, recipe=recipe, model=model_cfg, train=train_cfg, data=data_cfg, budgeted=budgeted,
        resumed=resumed, fixed=frozenset(fixed), world=world, cpu_threads=cpu_threads, step_s=step_s,
        time_threads=time_threads, time_bf16=time_bf16, first_guess=first_guess, regularisation=regularisation,
        adoption=adoption, notes=tuple(notes), saved_run=saved, tokenizer_sha256=data.tokenizer_sha256,
        init_from=None if init is None else init["record"],
    )  # fmt: skip


LONG_RUN_S = 86_400.0  # a run planned to outlast a day on the device it found is worth a word before it starts


def plan_warnings(request: TrainRequest, train_cfg: Any, fixed: set[str] | frozenset[str], budgeted: bool,
                  step_s: float | None, world: World) -> list[str]:  # fmt: skip
    """Lines starting ``warning:`` for a plan that is probably not what the user meant: no end given on a CPU (the
    recipe's step count), a run that would last more than a day at the measured step time, a flat learning rate.

    Example (a CPU run with neither --time-budget nor --max-steps, whose step was timed at 0.9 s):
        >>> from trainloop import TrainConfig
        >>> request = TrainRequest(data="d", out="r")
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
    if not budgeted and request.max_steps is None and "max_steps" not in fixed and not world.cuda:
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


def _base_configs(
    request: TrainRequest, meta: Mapping[str, Any], saved: Mapping[str, Any] | None, notes: list[str]
) -> tuple[Any, Any, DataConfig, str | None]:
    """(ModelConfig, TrainConfig, DataConfig, recipe name) before the request's overrides: a resumed run's saved
    configs (a recalibrated schedule would change its future), else the recipe's or the config file's."""
    from lmcore import ModelConfig
    from trainloop import TrainConfig

    if saved is not None:
        try:
            model_cfg = ModelConfig.from_dict(dict(saved["model_config"]))
            train_cfg = TrainConfig.from_dict(dict(saved["train_config"]))
            data_cfg = DataConfig(**saved["data_config"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            where = Path(request.out) / "run.json"
            raise LmtrainError(
                f"{where}: the run's saved configs do not load ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): expected the file `lmtrain train` wrote; restore "
                "it, or start the run over with --overwrite"
            ) from None
        asked = request.recipe or request.model_config
        if asked:
            notes.append(f"{'--preset' if request.recipe else '--model-config'} {asked} ignored: a resumed run keeps "
                         "the configs it started with (run.json); --overwrite starts it over")  # fmt: skip
        return model_cfg, train_cfg, data_cfg, saved.get("recipe")
    if request.model_config:
        model_cfg = model_config_file(request.model_config, meta["vocab_size"])
        match = recipe_matching(model_cfg)
        recipe = match.name if match else None
        train_cfg = match.train_config() if match else TrainConfig()
        data_cfg = match.data_config() if match else DataConfig()
    else:
        chosen = recipe_named(request.recipe or DEFAULT_RECIPE)
        recipe = chosen.name
        model_cfg = chosen.model_config(meta["vocab_size"])
        train_cfg, data_cfg = chosen.train_config(), chosen.data_config()
    if request.deepspeed is not None:
        train_cfg = dataclasses.replace(train_cfg, engine="deepspeed")
    return model_cfg, train_cfg, data_cfg, recipe


def model_config_file(path: str | Path, vocab_size: int | None = None) -> Any:
    """The lmcore ModelConfig in a JSON file, with the tokenizer's vocabulary size.

    The file's own vocab_size is kept when it is at least the tokenizer's (a padded vocabulary); smaller is an
    error, since token ids beyond the embedding table fail deep inside the model (device-side asserts on GPU).
    """
    from lmcore import ModelConfig

    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LmtrainError(f"--model-config {path}: cannot read a JSON object: {exc}") from exc
    if not isinstance(values, dict):
        raise LmtrainError(f"--model-config {path}: holds a {type(values).__name__}, expected a JSON object")
    try:
        config = ModelConfig.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise LmtrainError(f"--model-config {path}: {exc}") from exc
    if vocab_size is not None and config.vocab_size < vocab_size:
        if "vocab_size" in values:
            raise LmtrainError(
                f"--model-config {path}: vocab_size={config.vocab_size} is smaller than the tokenizer's "
                f"{vocab_size}; token ids would index past the embedding table"
            )
        config.vocab_size = vocab_size
    return config


def _check_token_counts(request: TrainRequest, meta: Mapping[str, Any], data: DataInfo, seq_len: int) -> None:
    """The data directory's own counts must match the data, and each split must hold at least one window."""
    where = request.blend_spec or request.data_dir
    recorded = meta["train"].get("tokens") if isinstance(meta["train"], dict) else None
    if request.blend_spec is None and isinstance(recorded, int) and recorded != data.train_tokens:
        raise LmtrainError(
            f"--data {where}: meta.json says the training split has {recorded:,} tokens, its token data holds "
            f"{data.train_tokens:,}: the two were not written together; re-run `lmtrain prepare`"
        )
    splits = [("training", data.train_tokens)]
    val_tokens = meta["val"].get("tokens") if isinstance(meta["val"], dict) else None
    if isinstance(val_tokens, int):
        splits.append(("validation", val_tokens))
    for split, tokens in splits:
        if tokens < seq_len + 1:
            raise LmtrainError(
                f"--data {where}: the {split} split has {tokens:,} tokens, fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}: prepare more text, or train shorter windows (--set seq_len={max(2, tokens - 1)})"
            )


def _document_separator(meta: Mapping[str, Any]) -> int:
    return document_separator_of(meta["train_path"])


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
