"""One run file: `lmtrain train --config run.toml` holds everything a run needs; flags override it.

A run file is TOML, YAML (``.yaml``/``.yml``, with the ``yaml`` extra: PyYAML) or the ``run.json`` of an earlier run,
read back as the config of a new one. Its top-level keys
are the :class:`~lmtrain.plan.TrainRequest` fields a run is made of; its ``[model]``, ``[train]`` and
``[data_config]`` tables set fields of the model, training and data configs, as ``--set model.x=...`` does (the data
table has a longer name because ``data`` is the data directory)::

    data = "data/shakespeare"      # a directory written by `lmtrain prepare`
    out = "runs/s1"
    recipe = "cpu-small"           # or: model_config = "model.json"
    time_budget_s = 260            # or: max_steps = 2000
    deepspeed = "ds_config.json"   # optional: train with DeepSpeed and this JSON

    [train]
    lr = 1e-3
    tensorboard = true

    [model]
    bias = false

Paths are taken relative to the file's directory. A flag given on the command line wins over the file's value
(``--set`` over a table's field). `lmtrain train --print-config` prints the merged run as such a file, with the
values the plan resolved, and exits. :func:`request_values` reads a file; :func:`plan_toml` writes one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (lmtrain's dependency there)
    import tomli as tomllib

# TrainRequest fields a run file may set (resume, overwrite and verify are what a command does, not what a run is).
REQUEST_KEYS = ("data", "out", "recipe", "model_config", "time_budget_s", "max_steps", "deepspeed",
                "document_attention", "gpumon", "compile")  # fmt: skip
PATH_KEYS = ("data", "out", "model_config", "deepspeed")
# The kind of value each key takes; every other key takes a string.
_KINDS: dict[str, tuple[type, ...]] = {
    "time_budget_s": (int, float),
    "max_steps": (int,),
    "document_attention": (bool,),
    "gpumon": (bool,),
    "compile": (bool,),
}
SECTIONS = {"model": "model", "train": "train", "data_config": "data"}  # table -> the --set prefix it stands for
# Sized by a time budget at launch: a run file taken from a budgeted run leaves them to the new run's budget.
_BUDGET_SIZED = ("max_steps", "t_max", "schedule", "wsd_decay_steps", "warmup_steps")


def read_run_file(path: str | Path) -> dict[str, Any]:
    """The run file at ``path`` (TOML, YAML, or an earlier run's ``run.json``) as ``{TrainRequest field: value, ...,
    "overrides": {"model.x": value, ...}}``; a file that does not parse, an unknown key or a value of the wrong kind
    is one LmtrainError naming it.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> work = tempfile.TemporaryDirectory()
        >>> run = Path(work.name) / "run.toml"
        >>> _ = run.write_text('data = "data"\\nrecipe = "tiny"\\nmax_steps = 20\\n[train]\\nlr = 1e-3\\n')
        >>> values = read_run_file(run)
        >>> values["recipe"], values["max_steps"], values["overrides"], values["data"] == str(Path(work.name) / "data")
        ('tiny', 20, {'train.lr': 0.001}, True)
        >>> work.cleanup()
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmtrainError(f"--config {path}: cannot read it ({exc}): expected a TOML run file or a run.json") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        raw = _read_yaml(text, path)
    elif path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LmtrainError(f"--config {path}: not JSON ({exc}): expected an earlier run's run.json") from None
        if not isinstance(raw, dict):
            raise LmtrainError(f"--config {path}: holds a {type(raw).__name__}, expected a JSON object (run.json)")
        from lmtrain.run_record import RunRecord

        raw = _from_run_json(RunRecord.from_json(raw, f"--config {path}"), path)
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise LmtrainError(f"--config {path}: not valid TOML ({exc}); see `lmtrain train --print-config`") from None
    return _request_values(raw, path)


def _read_yaml(text: str, path: Path) -> dict[str, Any]:
    """A YAML run file: the same keys and tables as the TOML one (PyYAML's safe loader: plain data, no objects)."""
    try:
        import yaml
    except ModuleNotFoundError:
        from trainloop.extras import install_hint

        raise LmtrainError(f"--config {path}: a YAML run file needs PyYAML, which is not installed: "
                           f"{install_hint('yaml', 'lmtrain')} (a TOML run file needs nothing)") from None  # fmt: skip
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LmtrainError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise LmtrainError(f"--config {path}: holds a {type(raw).__name__}, expected a mapping of run keys")
    return raw


def _from_run_json(run: Any, path: Path) -> dict[str, Any]:
    """An earlier run's record (lmtrain.run_record) as a run file: its data, recipe and resolved configs (the
    schedule fields a time budget sized are left to the new run's budget)."""
    if run.command != "train":
        raise LmtrainError(f"--config {path}: the run.json of a `lmtrain {run.command}` run: expected one that "
                           "`lmtrain train` wrote (a fine-tune's settings are `lmtrain finetune`'s flags)")  # fmt: skip
    train = dict(run.train_config)
    out: dict[str, Any] = {"model": dict(run.model_config), "train": train}
    if train.get("t_max") is not None and train.get("t_max") == train.get("max_steps"):
        # The decay's end followed the run's end (--max-steps): as a request, it follows a new --max-steps too.
        train.pop("t_max")
        out["max_steps"] = train.pop("max_steps")
    out["data_config"] = dict(run.data_config)
    if run.data is not None:
        out["data"] = run.data
    if run.recipe is not None:
        out["recipe"] = run.recipe
    if run.schedule == "budget":
        for name in _BUDGET_SIZED:
            train.pop(name, None)
        if train.get("time_budget_s") is not None:
            out["time_budget_s"] = train.pop("time_budget_s")
    return out


def _request_values(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise LmtrainError(f"--config {path}: {key} = {value!r}: expected a table ([{key}]) of fields")
            overrides.update({f"{SECTIONS[key]}.{name}": item for name, item in value.items()})
        elif key in REQUEST_KEYS:
            values[key] = _checked(key, value, path)
        else:
            near = difflib.get_close_matches(key, [*REQUEST_KEYS, *SECTIONS], n=3, cutoff=0.5)
            near = ["recipe"] if key == "preset" else near
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise LmtrainError(
                f"--config {path}: unknown key {key!r}{hint} (top-level keys: {', '.join(REQUEST_KEYS)}; tables "
                f"[{'], ['.join(SECTIONS)}] set fields of the model, training and data configs)"
            )
    for key in PATH_KEYS:
        if isinstance(values.get(key), str) and not Path(values[key]).is_absolute():
            values[key] = str(path.parent / values[key])
    _check_fields(overrides, path)
    values["overrides"] = overrides
    return values


def _check_fields(overrides: Mapping[str, Any], path: Path) -> None:
    """Every table field names a field of its config, checked here so that the error names the file (the values
    are converted and validated with the configs, as `--set` values are)."""
    from lmcore import ModelConfig
    from lmtrain.errors import OverrideError
    from lmtrain.overrides import targets
    from lmtrain.recipes import DataConfig
    from trainloop import TrainConfig

    configs = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}
    for key in overrides:
        try:
            targets(key, configs)
        except OverrideError as exc:
            section, _, name = key.partition(".")
            table = next(t for t, prefix in SECTIONS.items() if prefix == section)
            said = str(exc).removeprefix(f"--set {key}: ")
            raise LmtrainError(f"--config {path}: [{table}] {name}: {said}") from None


def _checked(key: str, value: Any, path: Path) -> Any:
    expected = _KINDS.get(key, (str,))
    if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
        names: dict[tuple[type, ...], str] = {(int, float): "a number", (int,): "an integer", (bool,): "true or false"}
        raise LmtrainError(f"--config {path}: {key} = {value!r}: expected {names.get(expected, 'a string')}")
    seconds: Any = value
    if key == "time_budget_s" and not (math.isfinite(seconds) and seconds > 0):
        raise LmtrainError(f"--config {path}: time_budget_s = {value!r}: expected a finite number of seconds > 0")
    return value


def plan_toml(plan: Any) -> str:
    """The run ``plan`` (a :class:`~lmtrain.plan.RunPlan`) as a TOML run file that `lmtrain train --config` reads
    back into the same run: the request's keys and the fields you set are lines, every other resolved field of the
    model, training and data configs is shown as a comment (the recipe's value, or one the plan decides: a comment
    leaves it to the plan, uncommented it becomes yours)."""
    request = plan.request
    lines = [
        "# lmtrain run file: `lmtrain train --config THIS_FILE` trains this run; flags given beside it override it.",
        f"# Model and settings from {'recipe ' + plan.recipe if plan.recipe else 'a model config file'}. A commented "
        "field shows the resolved value",
        "# and is left to the recipe and the plan; uncomment it to set it.",
        *(f"# plan: {note}" for note in plan.notes),  # what the plan decided or warns of, warnings included
    ]
    for key in REQUEST_KEYS:
        value = getattr(request, key)
        if key in ("data", "out") and not value:
            lines.append(
                f'# {key} = "{"DATA_DIR" if key == "data" else "RUN_DIR"}"  (the '
                f"{'prepared data' if key == 'data' else 'run directory'}: give it here or with --{key})"
            )
            continue
        if key == "recipe" and value is None and request.model_config is None:
            value = plan.recipe
        if key in PATH_KEYS and isinstance(value, str):
            value = str(Path(value).resolve())
        if value is None or (value is False and key in ("document_attention", "gpumon", "compile")):
            continue
        if key == "deepspeed" and not isinstance(value, str):
            continue  # a dict given to lmtrain.train(): its adopted values are in [train]
        lines.append(f"{key} = {_toml(value)}")
    train, marks = _decided_at_start(plan)
    for section, config in (("model", plan.model.to_dict()), ("train", train.to_dict()),
                            ("data_config", dataclasses.asdict(plan.data))):  # fmt: skip
        lines += ["", f"[{section}]"]
        for name, value in config.items():
            if section == "train" and name == "time_budget_s":
                continue  # the top-level time_budget_s
            text = f"{name} = {_toml(value)}"
            if name not in plan.fixed:
                text = f"# {text}{marks.get(f'{section}.{name}', '')}"
            lines.append(text)
    return "\n".join(lines) + "\n"


def _decided_at_start(plan: Any) -> tuple[Any, dict[str, str]]:
    """The training config as the run will start (a budget's schedule sized already, at the whole budget) and a
    mark for each field the command decides at launch (the budget, a probe), keyed ``section.name``."""
    from trainloop import BUDGET

    train, marks = plan.train, {}
    if plan.budgeted and plan.measuring:
        train, _ = BUDGET.configure(plan.train, float(plan.request.time_budget_s), None, keep=plan.fixed)
        sized = set(_BUDGET_SIZED) | {f.name for f in dataclasses.fields(train)
                                      if getattr(train, f.name) != getattr(plan.train, f.name)}  # fmt: skip
        marks.update({f"train.{name}": "  (sized to the time budget at launch)" for name in sized})
        if plan.request.model_config is None:
            regularised = "  (the budget's regularisation decides at launch: lmtrain.planner)"
            marks.update({"model.dropout": regularised, "train.weight_decay": regularised})
    world = plan.world
    if plan.time_bf16 or (plan.budgeted and plan.measuring and world.single_cpu_process and world.native_bf16
                          and train.precision == "fp32" and "precision" not in plan.fixed):  # fmt: skip
        marks["train.precision"] = "  (fp32 or bf16: a timed step at launch decides, kept afterwards: lmtrain.probes)"
    if plan.time_threads or world.recorded_threads is not None:
        marks["data_config.cpu_threads"] = "  (one thread or all cores: timed at launch, kept afterwards)"
    if not getattr(plan.request, "data", ""):
        marks["model.vocab_size"] = "  (the tokenizer's: give --data)"
    return train, marks


def _toml(value: Any) -> str:
    """A TOML value; None is the string "none", which the field's type converts back to None."""
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")
