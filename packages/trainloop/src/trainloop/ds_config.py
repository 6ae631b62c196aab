"""A DeepSpeed JSON config as the user's word: its values adopted into TrainConfig, ``"auto"`` filled from the run,
and the config handed to ``deepspeed.initialize``.

The loop keeps the optimizer, the schedule and the clipping. The JSON's batch keys and bf16/fp16 block become
TrainConfig's ``micro_batch``, ``grad_accum`` and ``precision``; its AdamW block becomes ``lr``, ``beta1``,
``beta2``, ``eps``, ``weight_decay`` (the loop builds the optimizer, torch's fused AdamW, also when ZeRO offloads it);
a WarmupLR, WarmupDecayLR or WarmupCosineLR block becomes the loop's schedule (it sets the learning rate every
step); ``gradient_clipping`` becomes ``clip`` (the loop clips per group, DeepSpeed's own clipping stays 0).
``"auto"`` takes the run's value, as in Hugging Face's DeepSpeed integration. A top-level key the installed DeepSpeed
never reads is an error naming the keys nearest to it (DeepSpeed itself would drop it without a word).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainloop.config import ConfigError, TrainConfig
from trainloop.offload import offload_device, offload_problems

AUTO = "auto"
DICT_NAME = "the DeepSpeed config"  # how messages name a config given as a dict
TBS, MICRO, ACCUM = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
# DeepSpeed scheduler type -> the loop's schedule that draws the same curve after a linear warmup.
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "wsd", "WarmupCosineLR": "cosine"}
# Optimizer params that the loop's AdamW already has as given; other values of these cannot be honoured.
ADAMW_AS_IS = {"adam_w_mode": True, "bias_correction": True, "amsgrad": False}
# Fields DeepSpeed itself runs with: a TrainConfig that disagrees with the JSON on these cannot train.
ENGINE_FIELDS = ("micro_batch", "grad_accum", "precision", "scaler_init_scale", "scaler_growth_interval")


@dataclass(frozen=True)
class ResolvedDSConfig:
    """A DeepSpeed config resolved for one TrainConfig and world size (:func:`build_ds_config`): the dict that
    ``deepspeed.initialize`` gets as it is, and the lines saying what the run took from the JSON."""

    config: dict[str, Any]
    notes: tuple[str, ...]

    def __init__(self, config: dict[str, Any], notes: Collection[str]) -> None:
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "notes", tuple(notes))


@dataclass
class Adoption:
    """What a DeepSpeed config made of a run: the TrainConfig with the JSON's values (``config``) and the fields they
    set. The config for ``deepspeed.initialize`` is resolved from it when first asked for (``ds_config``, ``line``,
    or :meth:`resolved_for` the TrainConfig the run ends up with), once."""

    config: TrainConfig
    fields: frozenset[str]  # the TrainConfig fields whose value came from the DeepSpeed config
    source: dict[str, Any]  # the JSON as read
    world_size: int
    on_cpu: bool
    name: str = DICT_NAME
    _resolved: dict[int, ResolvedDSConfig] = field(default_factory=dict, repr=False, compare=False)

    def resolved_for(self, config: TrainConfig) -> ResolvedDSConfig:
        """The config for ``deepspeed.initialize`` for ``config`` (the adopted one, or it after later changes such
        as a batch re-split on resume), built on the first call for each config and kept."""
        key = hash(json.dumps(config.to_dict(), sort_keys=True, default=str))
        if key not in self._resolved:
            ds, notes = build_ds_config(self.source, config, self.world_size, on_cpu=self.on_cpu, name=self.name)
            self._resolved[key] = ResolvedDSConfig(ds, notes)
        return self._resolved[key]

    @property
    def ds_config(self) -> dict[str, Any]:
        """The config ``deepspeed.initialize`` gets for the adopted TrainConfig."""
        return self.resolved_for(self.config).config

    @property
    def line(self) -> str:
        """One line saying what the run took from the JSON and what became of each block."""
        return self.resolved_for(self.config).notes[0]


@dataclass
class _Found:
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)  # TrainConfig field -> (value, where from)
    filled: list[str] = field(default_factory=list)  # JSON paths whose "auto" took the run's value
    unused: list[str] = field(default_factory=list)  # JSON values the run's TrainConfig overrides
    conflicts: list[str] = field(default_factory=list)  # JSON values that differ from ones set on purpose
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def load_ds_config(source: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    """A DeepSpeed config from a dict (copied) or a JSON file; ``ConfigError`` in one line for anything else."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if dup := sorted({k for k in keys if keys.count(k) > 1}):
            raise ConfigError(f"DeepSpeed config {path}: key(s) {dup} appear twice in one object: keep one")
        return dict(pairs)

    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {path}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config {path}: not UTF-8 text (byte {exc.start}: {exc.reason}; a binary file?); DeepSpeed "
            "configs are plain JSON objects"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config {path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); "
            "DeepSpeed configs are plain JSON objects"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path}: holds a {type(data).__name__}, expected a JSON object")
    return data


def adopt_ds_config(
    source: dict[str, Any] | str | Path | None,
    config: TrainConfig,
    world_size: int,
    *,
    on_cpu: bool,
    explicit: Collection[str] = (),
    explicit_prefix: str = "TrainConfig.",
    check: bool = True,
) -> Adoption:
    """Take the DeepSpeed config's values into ``config``: they win over its values, except those named in
    ``explicit`` (fields the user set on purpose): a JSON value that differs from one of those is a conflict, and
    one ``ConfigError`` lists every conflict and every value that cannot work. With ``check`` (the default) the result
    is checked by DeepSpeed's own config parser at once; without, when it is first resolved (``resolved_for``), e.g.
    after later changes to the TrainConfig, so that it is resolved only once.

    Example:
        >>> ref = {"train_batch_size": 128, "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW"}}
        >>> adopt_ds_config(ref, TrainConfig(micro_batch=8), 16, on_cpu=False).config.micro_batch
        2
    """
    ds = load_ds_config(source)
    found = _read(ds, config, world_size, on_cpu, set(explicit), strict=None, prefix=explicit_prefix)
    by = explicit_prefix.strip().rstrip(".")
    _raise_problems(found, _name(source), f"set there and by {by} to different values", "keep one of each")
    adopted = {k: v for k, (v, _) in found.values.items()}
    try:
        new = dataclasses.replace(config, **adopted)
    except ConfigError as exc:
        wheres = ", ".join(f"{k} from {where}" for k, (_, where) in found.values.items())
        raise ConfigError(f"{_title(_name(source))}: {exc} (adopted: {wheres})") from exc
    adoption = Adoption(new, frozenset(found.values), ds, world_size, on_cpu, _name(source))
    if check:
        adoption.resolved_for(new)  # DeepSpeed's own parser, now; the result is kept
    return adoption


def build_ds_config(
    source: dict[str, Any] | str | Path | None,
    config: TrainConfig,
    world_size: int,
    *,
    on_cpu: bool,
    name: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The config for ``deepspeed.initialize`` and a one-element list with the line that says what the run took
    from the JSON. The batch keys and the precision must agree with ``config`` (as after :func:`adopt_ds_config`);
    where the JSON's optimizer, schedule or clipping values differ from ``config``, the run's are used and the line
    says so. The optimizer and scheduler blocks are removed (the loop passes its own optimizer and sets the
    learning rate), ``gradient_clipping`` is 0.

    Example:
        >>> cfg = TrainConfig(micro_batch=4, grad_accum=2)
        >>> ds, notes = build_ds_config({"zero_optimization": {"stage": 2}}, cfg, 2, on_cpu=True)
        >>> ds["train_batch_size"]
        16
    """
    ds = load_ds_config(source)
    original = copy.deepcopy(ds)
    name = name or _name(source)
    every = {f.name for f in dataclasses.fields(TrainConfig)}
    found = _read(ds, config, world_size, on_cpu, every, strict=set(ENGINE_FIELDS), prefix="TrainConfig.")
    if on_cpu and config.precision == "fp16":
        found.problems.append("TrainConfig.precision='fp16' does not work with DeepSpeed on CPU: use 'bf16' or 'fp32'")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        found.problems.append(f"zero_optimization={zero!r} must be a JSON object")
    elif zero.get("stage", config.zero_stage) not in (0, 1, 2, 3):
        found.problems.append(f"zero_optimization.stage={zero['stage']!r}: allowed values are 0, 1, 2, 3")
    else:
        found.problems += offload_problems(zero, zero.get("stage", config.zero_stage))
    _raise_problems(found, name, "disagrees with the TrainConfig", "adopt it with trainloop.adopt_ds_config first")

    ds.pop("optimizer", None)
    ds.pop("scheduler", None)
    ds["gradient_clipping"] = 0.0
    ds[TBS] = config.micro_batch * config.grad_accum * world_size
    ds[MICRO], ds[ACCUM] = config.micro_batch, config.grad_accum
    bf16_key = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"
    for key, precision in ((bf16_key, "bf16"), ("fp16", "fp16")):
        on = config.precision == precision
        if on or isinstance(ds.get(key), dict):
            given = ds.get(key)
            block: dict[str, Any] = given if isinstance(given, dict) else {}
            ds[key] = {**block, "enabled": on}
    if config.precision == "fp16":
        ds["fp16"].update(initial_scale_power=int(math.log2(config.scaler_init_scale)),
                          loss_scale_window=config.scaler_growth_interval)  # fmt: skip
    ds["zero_optimization"] = {"stage": config.zero_stage, **zero}
    offload = _offload_device(ds)
    # The loop's fused torch AdamW steps the offloaded partitions (make_adamw says why); DeepSpeed would otherwise
    # insist on its own CPU Adam.
    ds["zero_force_ds_cpu_optimizer"] = False
    ds["zero_allow_untested_optimizer"] = True
    ds.setdefault("steps_per_print", 10**9)
    left = _drop_auto(ds)
    if left:
        found.notes.append(f"'auto' left to DeepSpeed's defaults: {', '.join(left)}")
    _deepspeed_check(ds, name)
    return ds, [_line(name, ds_in=original, config=config, world_size=world_size, offload=offload,
                      found=found)]  # fmt: skip


def _offload_device(ds: dict[str, Any]) -> str | None:
    """``"cpu"`` or ``"nvme"`` when ZeRO offloads the optimizer (its step then runs on the host), else None."""
    return offload_device(ds.get("zero_optimization") or {}, "offload_optimizer")


# ------------------------------------------------------------------------------------------------ reading the JSON
def _read(
    ds: dict[str, Any],
    config: TrainConfig,
    world: int,
    on_cpu: bool,
    explicit: set[str],
    *,
    strict: set[str] | None,
    prefix: str,
) -> _Found:
    """Every TrainConfig value the JSON sets. A JSON value that differs from an ``explicit`` field is a problem
    when the field is ``strict`` (None: all are), else it is reported as unused."""
    found = _Found()
    _check_top_level_keys(ds, found)

    def take(name: str, value: Any, where: str) -> None:
        ours = getattr(config, name)
        if name in explicit and value != ours:
            if strict is None or name in strict:
                found.conflicts.append(f"{name}: {_fmt(value)} from {where} vs {_fmt(ours)} from {prefix}{name}")
            else:
                found.unused.append(f"{name} {_fmt(ours)} rather than {_fmt(value)} from {where}")
            return
        found.values[name] = (value, where)

    _read_batch(ds, config, world, explicit if strict is None else set(), prefix, take, found)
    _read_precision(ds, config, on_cpu, take, found)
    clip = ds.get("gradient_clipping")
    if clip == AUTO:
        found.filled.append("gradient_clipping")
    elif clip is not None:
        take("clip", clip, "gradient_clipping")
    _read_optimizer(ds.get("optimizer"), take, found)
    _read_scheduler(ds.get("scheduler"), config, take, found)
    return found


def _check_top_level_keys(ds: dict[str, Any], found: _Found) -> None:
    """A top-level key DeepSpeed never reads is a problem naming the nearest keys it does read: DeepSpeed itself
    drops such a key without a word (a misspelt ``train_batch_size`` would leave the batch to the defaults)."""
    known = deepspeed_top_level_keys()
    if known is None or not set(ds) - known:
        return
    known |= deepspeed_top_level_keys(ds) or set()  # also what only this config's values make DeepSpeed read
    for key in sorted(set(ds) - known):
        near = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        found.problems.append(f"unknown top-level key {key!r}: DeepSpeed reads no such key ({hint}fix or remove it)")


class _KeyRecorder(dict):
    """A config dict that records every key looked up in it; copies of it are itself, so that the lookups on the
    copy DeepSpeed's parser takes are recorded too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # `key in config.keys()` is a lookup too
        return _RecordedKeys(self)

    def __copy__(self) -> _KeyRecorder:
        return self


class _RecordedKeys:
    def __init__(self, recorder: _KeyRecorder) -> None:
        self._recorder = recorder

    def __contains__(self, key: object) -> bool:
        return key in self._recorder

    def __iter__(self) -> Any:
        return iter(dict.keys(self._recorder))

    def __len__(self) -> int:
        return dict.__len__(self._recorder)


def _parser_lookups(config: dict[str, Any]) -> set[str] | None:
    """The top-level keys DeepSpeed's config parser looks up while it parses ``config`` (up to where it refuses
    it, if it does); None without DeepSpeed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ModuleNotFoundError:
        return None
    probe = _KeyRecorder(copy.deepcopy(config))  # the parser may change what it is given
    # A config it refuses: the lookups up to there still count (_deepspeed_check says why it is refused).
    with contextlib.suppress(Exception):
        DeepSpeedConfig(probe)
    return {k for k in probe.looked_up if isinstance(k, str)}


@functools.cache
def _initialize_lookups() -> frozenset[str]:
    """The keys ``deepspeed.initialize`` looks up in the config before its parser sees it, read off its source:
    ``"key" in config``, ``config["key"]``, ``config.get("key")``."""
    import deepspeed

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(deepspeed.initialize)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names = {"config", "config_params"}  # its parameters that hold the config

    def is_config(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in names

    keys = set()
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left if is_config(node.comparators[0]) else None
        elif isinstance(node, ast.Subscript) and is_config(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if is_config(node.func.value) and node.args else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            keys.add(key.value)
    return frozenset(keys)


# The lookups on a minimal config, once found; nothing is kept while DeepSpeed cannot be imported.
_minimal: list[frozenset[str]] = []


def _minimal_lookups() -> frozenset[str] | None:
    if not _minimal:
        found = _parser_lookups({MICRO: 1})
        if found is None:
            return None
        _minimal.append(frozenset(found))
    return _minimal[0]


def deepspeed_top_level_keys(config: dict[str, Any] | None = None) -> frozenset[str] | None:
    """The top-level keys the installed DeepSpeed reads from a config (and from ``config``, where a key's value makes
    it read more); None without DeepSpeed.

    Found in DeepSpeed itself, so that the set is the installed release's: the keys its config parser
    (``DeepSpeedConfig``) looks up while it parses a minimal config and ``config``, and those
    ``deepspeed.initialize`` looks up before the parser sees the config. Keys of features a release removed are
    among them where it looks for them to refuse them, with its own message.

    Example (needs the deepspeed extra):
        >>> keys = deepspeed_top_level_keys()
        >>> {"train_batch_size", "zero_optimization", "wall_clock_breakdown", "sequence_parallel_size"} <= keys
        True
        >>> "trian_batch_size" in keys
        False
    """
    minimal = _minimal_lookups()
    if minimal is None:
        return None
    extra = (_parser_lookups(config) or set()) if config else set()
    return minimal | _initialize_lookups() | extra


def _read_batch(ds: dict, config: TrainConfig, world: int, pinned: set[str], prefix: str, take, found) -> None:
    """The batch keys, the missing one derived as DeepSpeed does (``pinned`` fields count as given)."""
    nums: dict[str, int] = {}
    for key in (TBS, MICRO, ACCUM):
        value = ds.get(key)
        if value == AUTO:
            found.filled.append(key)
        elif value is not None:
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                found.problems.append(f'{key}={value!r} must be a positive integer or "auto"')
                return
            nums[key] = value
    tbs = nums.get(TBS)
    if tbs is None:
        for key, name in ((MICRO, "micro_batch"), (ACCUM, "grad_accum")):
            if key in nums:
                take(name, nums[key], key)
        return
    given: dict[str, tuple[int, str]] = {}  # the JSON's value, else one set on purpose (labelled for messages)
    for key, name in ((MICRO, "micro_batch"), (ACCUM, "grad_accum")):
        if key in nums:
            given[name] = (nums[key], key)
        elif name in pinned:
            given[name] = (getattr(config, name), f"{prefix}{name}")
    (mb, mb_src), (ga, ga_src) = given.get("micro_batch", (None, "")), given.get("grad_accum", (None, ""))
    if mb is not None and ga is not None:
        if tbs != mb * ga * world:
            hints = [f"{kind} {tbs // (other * world)}" for kind, other in (("micro batch", ga), ("accumulation", mb))
                     if tbs % (other * world) == 0]  # fmt: skip
            found.problems.append(
                f"{TBS}={tbs} but {mb_src}={mb} x {ga_src}={ga} x {world} rank(s) = {mb * ga * world}: on {world} "
                f"rank(s) use {' or '.join([*hints, f'{TBS} {mb * ga * world}'])}"
            )
            return
    elif mb is not None:
        ga = _split(tbs, mb, f"{mb_src}={mb}", world, found)
        if ga is not None:
            take("grad_accum", ga, f"{TBS} {tbs} / ({mb} x {world} ranks)")
    else:
        if ga is None:  # only train_batch_size: the run's accumulation where it divides, else DeepSpeed's 1
            ga, ga_src = config.grad_accum, "the run's grad_accum"
            if tbs % (ga * world):
                ga, ga_src = 1, "DeepSpeed's default accumulation"
                take("grad_accum", 1, f"{ga_src} for {TBS} alone")
        mb = _split(tbs, ga, f"{ga_src}={ga}", world, found)
        if mb is not None:
            take("micro_batch", mb, f"{TBS} {tbs} / ({ga} x {world} ranks)")
    for key, name in ((MICRO, "micro_batch"), (ACCUM, "grad_accum")):
        if key in nums:
            take(name, nums[key], key)


def _split(tbs: int, other: int, other_src: str, world: int, found: _Found) -> int | None:
    """``train_batch_size / (other x world)``, or a problem naming the numbers and the fix."""
    if tbs % (other * world) == 0:
        return tbs // (other * world)
    fits = [n for n in range(1, min(tbs // other, 1024) + 1) if (tbs // other) % n == 0] if tbs % other == 0 else []
    fix = f"run on {', '.join(map(str, fits[:12]))} rank(s), or " if fits else ""
    found.problems.append(
        f"{TBS}={tbs} cannot be split over {world} rank(s) with {other_src}: {tbs} / ({other} x {world}) = "
        f"{tbs / (other * world):.4g} rows per micro-batch; {fix}make {TBS} a multiple of {other * world}"
    )
    return None


def _read_precision(ds: dict, config: TrainConfig, on_cpu: bool, take, found: _Found) -> None:
    enabled = {}
    for key, precision in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        block = ds.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            found.problems.append(f'{key}={block!r} must be a JSON object such as {{"enabled": true}}')
            continue
        if block.get("enabled") == AUTO:
            found.filled.append(f"{key}.enabled")
        elif "enabled" in block:
            enabled[precision] = (block["enabled"] is True, f"{key}.enabled")
    on = [p for p, (flag, _) in enabled.items() if flag]
    if len(on) > 1:
        found.problems.append("bf16 and fp16 are both enabled: DeepSpeed runs one of them")
    elif on:
        precision, where = on[0], enabled[on[0]][1]
        if precision == "fp16" and on_cpu:
            precision, where = "bf16", f"{where}, bf16 on CPU"
            found.notes.append("on CPU fp16 became bf16 (DeepSpeed has no fp16 on CPU)")
        take("precision", precision, where)
        fp16 = ds.get("fp16", {})
        if precision == "fp16" and isinstance(fp16.get("initial_scale_power"), int):
            take("scaler_init_scale", float(2 ** fp16["initial_scale_power"]), "fp16.initial_scale_power")
        if precision == "fp16" and isinstance(fp16.get("loss_scale_window"), int):
            take("scaler_growth_interval", fp16["loss_scale_window"], "fp16.loss_scale_window")
    elif config.precision in enabled:  # the run's precision is switched off, and no other on: fp32
        take("precision", "fp32", enabled[config.precision][1])


def _read_optimizer(opt: Any, take, found: _Found) -> None:
    if opt is None:
        return
    if not isinstance(opt, dict):
        found.problems.append(f"optimizer={opt!r} must be a JSON object")
        return
    if str(opt.get("type", "AdamW")).lower() not in ("adam", "adamw"):
        found.problems.append(f"optimizer type {opt.get('type')!r}: the loop trains with AdamW (type AdamW or Adam)")
    params = opt.get("params", {}) or {}
    for key, name in (("lr", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if params.get(key) == AUTO:
            found.filled.append(f"optimizer.params.{key}")
        elif key in params:
            take(name, params[key], f"optimizer.params.{key}")
    betas = params.get("betas")
    if betas == AUTO:
        found.filled.append("optimizer.params.betas")
    elif betas is not None:
        if isinstance(betas, list) and len(betas) == 2:
            take("beta1", betas[0], "optimizer.params.betas[0]")
            take("beta2", betas[1], "optimizer.params.betas[1]")
        else:
            found.problems.append(f"optimizer.params.betas={betas!r} must be a list of two numbers")
    for key, want in ADAMW_AS_IS.items():
        if key in params and params[key] != want:
            found.problems.append(f"optimizer.params.{key}={_fmt(params[key])}: the loop's AdamW has {_fmt(want)}")
    ignored = sorted(set(params) - {"lr", "eps", "weight_decay", "betas", *ADAMW_AS_IS})
    if ignored:
        found.notes.append(f"optimizer params {ignored} ignored (implementation choices of DeepSpeed's own Adam)")


def _read_scheduler(sched: Any, config: TrainConfig, take, found: _Found) -> None:
    if sched is None:
        return
    kind = sched.get("type") if isinstance(sched, dict) else None
    if kind not in SCHEDULERS:
        found.problems.append(
            f"scheduler type {kind!r}: the loop's schedules express {', '.join(SCHEDULERS)} (linear warmup, then "
            "constant, linear or cosine decay); remove the block to use the run's schedule"
        )
        return
    params = sched.get("params", {}) or {}
    for key in params:
        if params[key] == AUTO:
            found.filled.append(f"scheduler.params.{key}")
    p = {k: v for k, v in params.items() if v != AUTO}
    take("schedule", SCHEDULERS[kind], f"scheduler.type {kind}")
    if "warmup_num_steps" in p:
        take("warmup_steps", p["warmup_num_steps"], "scheduler.params.warmup_num_steps")
    if "total_num_steps" in p:
        take("t_max", p["total_num_steps"], "scheduler.params.total_num_steps")
    if kind == "WarmupCosineLR":
        if "cos_min_ratio" in p:
            lr = found.values.get("lr", (config.lr,))[0]
            take("min_lr", p["cos_min_ratio"] * lr, "scheduler.params.cos_min_ratio x lr")
        if p.get("warmup_min_ratio", p.get("cos_min_ratio")) != p.get("cos_min_ratio"):
            found.notes.append("warmup starts at min_lr (the loop's warmup), not at warmup_min_ratio x lr")
        found.notes.append("the cosine is DeepSpeed's WarmupCosineLR one step later (it peaks at the warmup's end)")
    else:
        if "warmup_max_lr" in p:  # DeepSpeed's peak: it overrides the optimizer's lr
            found.values.pop("lr", None)
            take("lr", p["warmup_max_lr"], "scheduler.params.warmup_max_lr")
        if "warmup_min_lr" in p:
            take("min_lr", p["warmup_min_lr"], "scheduler.params.warmup_min_lr")
    if kind == "WarmupDecayLR":
        t_max = found.values.get("t_max", (config.t_max,))[0]
        warm = found.values.get("warmup_steps", (config.warmup_steps,))[0]
        if isinstance(t_max, int) and isinstance(warm, int):
            take("wsd_decay_steps", max(0, t_max - warm), "WarmupDecayLR's linear decay after warmup")
    if p.get("warmup_type", "log") != "linear":
        found.notes.append("its warmup is linear here (DeepSpeed's warmup_type 'log' has no counterpart)")


# ------------------------------------------------------------------------------------------------ reporting
def _line(name: str, *, ds_in: dict, config: TrainConfig, world_size: int, offload: str | None, found: _Found) -> str:
    took = [f"{k}={_fmt(v)} ({where})" for k, (v, where) in found.values.items()]
    parts = [f"{name} took " + (", ".join(took) if took else "no training values")]
    if found.unused:
        parts.append("not used, the run's TrainConfig differs: " + ", ".join(found.unused))
    if found.filled:
        parts.append("'auto' filled from the run: " + ", ".join(found.filled))
    opt = ds_in.get("optimizer")
    where = f", on the host for offload_optimizer {offload}" if offload else ""
    run_opt = f"lr {config.lr:g} on the schedule, betas ({config.beta1:g}, {config.beta2:g}), eps {config.eps:g}, " \
              f"weight_decay {config.weight_decay:g} on matrices"  # fmt: skip
    parts.append(
        (f"its {opt.get('type', 'AdamW')} block" if isinstance(opt, dict) else "no optimizer block")
        + f": the loop builds torch AdamW (fused{where}) with {run_opt}"
    )
    sched = ds_in.get("scheduler")
    curve = {"constant": "constant", "wsd": f"linear decay over the last {config.wsd_decay_steps} steps",
             "cosine": "cosine decay"}[config.schedule]  # fmt: skip
    parts.append(
        (f"its {sched.get('type')} block" if isinstance(sched, dict) else "no scheduler block")
        + f": the loop sets the lr each step (schedule {config.schedule}: warmup {config.warmup_steps} steps from "
        f"{config.min_lr:g} to {config.lr:g}, {curve} to {config.min_lr:g} at step {config.t_max})"
    )
    param_device = offload_device(ds_in.get("zero_optimization") or {}, "offload_param")
    if param_device is not None:
        path = ds_in["zero_optimization"]["offload_param"].get("nvme_path")
        parts.append(f"ZeRO-3 keeps the parameter partitions on {param_device}" + (f" ({path})" if path else ""))
    parts.append(f"the loop clips per group (clip={config.clip}), DeepSpeed's gradient_clipping is 0")
    parts.append(
        f"batch {config.micro_batch} x {config.grad_accum} x {world_size} rank(s) = "
        f"{config.micro_batch * config.grad_accum * world_size}, {config.precision}"
    )
    return "; ".join(parts + found.notes)


def _raise_problems(found: _Found, name: str, conflict: str, fix: str) -> None:
    """One ConfigError with every conflict and every value that cannot work, or nothing."""
    problems = list(found.problems)
    if found.conflicts:
        problems.insert(0, f"{conflict}: {', '.join(found.conflicts)} ({fix})")
    if problems:
        raise ConfigError(f"{_title(name)}: " + "; ".join(problems))


def _deepspeed_check(ds: dict[str, Any], name: str) -> None:
    """DeepSpeed's own parser on the final config: an unknown key in a block, a bad enum value, a removed key."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ModuleNotFoundError:  # the engine says which extra installs it when it is needed
        return
    # Without a process group DeepSpeed assumes one rank; the batch has been checked against the real one above.
    probe = {k: v for k, v in ds.items() if k != TBS}
    try:
        DeepSpeedConfig(probe)
    except Exception as exc:  # pydantic's ValidationError, AssertionError, DeepSpeedConfigError
        errors = getattr(exc, "errors", None)
        if callable(errors):
            block = {"DeepSpeedZeroConfig": "zero_optimization.", "DeepSpeedBF16Config": "bf16.",
                     "DeepSpeedFP16Config": "fp16."}.get(getattr(exc, "title", ""), "")  # fmt: skip
            what = "; ".join(f"{block}{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
                             for e in errors())  # fmt: skip
        else:
            what = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{_title(name)}: DeepSpeed rejects it: {what}") from exc


def _drop_auto(tree: dict[str, Any], path: str = "") -> list[str]:
    """Remove the "auto" values nothing filled (DeepSpeed then uses its defaults); their paths."""
    left = []
    for key in list(tree):
        if tree[key] == AUTO:
            del tree[key]
            left.append(path + key)
        elif isinstance(tree[key], dict):
            left += _drop_auto(tree[key], f"{path}{key}.")
    return left


def _name(source: Any) -> str:
    return Path(source).name if isinstance(source, (str, Path)) else DICT_NAME


def _title(name: str) -> str:
    return "DeepSpeed config" if name == DICT_NAME else f"DeepSpeed config {name}"


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)
