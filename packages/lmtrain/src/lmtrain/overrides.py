"""`--set key=value`: override any field of the model, training or data config by name.

Values are converted with the dataclass field's annotated type (int, float, bool, str, optional, tuples,
lists and dicts as JSON), and the new config is built with `dataclasses.replace`, so the config's own
`__post_init__` validation runs on the result. A key may be prefixed with the config's name
(`model.dropout`, `train.seed`) where a name exists in several configs; unprefixed, it sets every config that
has that field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from lmtrain.errors import OverrideError

# Names other tools (nanoGPT, transformers' TrainingArguments, DeepSpeed, litgpt, torchtitan) give the same setting:
# an unknown key that is one of these is answered with our name first, before the near matches by spelling.
SYNONYMS = {
    "learning_rate": "lr", "max_lr": "lr", "peak_lr": "lr", "eta_min": "min_lr", "min_learning_rate": "min_lr",
    "lr_warmup_steps": "warmup_steps", "warmup_iters": "warmup_steps", "warmup": "warmup_steps",
    "lr_decay_iters": "t_max", "decay_steps": "t_max", "max_iters": "max_steps", "steps": "max_steps",
    "train_steps": "max_steps", "batch_size": "micro_batch", "micro_batch_size": "micro_batch",
    "per_device_train_batch_size": "micro_batch", "train_micro_batch_size_per_gpu": "micro_batch",
    "gradient_accumulation_steps": "grad_accum", "grad_accum_steps": "grad_accum", "max_grad_norm": "clip",
    "grad_clip": "clip", "gradient_clipping": "clip", "adam_beta1": "beta1", "adam_beta2": "beta2",
    "adam_epsilon": "eps", "eval_interval": "eval_every", "eval_steps": "eval_every", "log_interval": "log_every",
    "logging_steps": "log_every", "save_steps": "save_every", "checkpoint_interval": "save_every",
    "block_size": "seq_len", "max_seq_len": "seq_len", "seq_length": "seq_len", "context": "seq_len",
    "n_embd": "d_model", "hidden_size": "d_model", "dim": "d_model", "n_layers": "n_layer",
    "num_layers": "n_layer", "num_hidden_layers": "n_layer", "n_heads": "n_head", "num_heads": "n_head",
    "num_attention_heads": "n_head", "n_kv_heads": "n_kv_head", "num_key_value_heads": "n_kv_head",
    "intermediate_size": "d_ff", "ffn_dim": "d_ff", "max_position_embeddings": "context_length",
    "dropout_rate": "dropout", "dtype": "precision", "mixed_precision": "precision", "bf16": "precision",
    "fp16": "precision", "random_seed": "seed", "zero_optimization": "zero_stage",
    "patience": "early_stopping_patience",
    "wandb": "wandb_project", "tb": "tensorboard", "num_threads": "cpu_threads", "threads": "cpu_threads",
}  # fmt: skip
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_pairs(pairs: Sequence[str]) -> list[tuple[str, str]]:
    """Split `key=value` strings; the value may itself contain '='.

    Example:
        >>> parse_pairs(["lr=3e-4", "name=a=b"])
        [('lr', '3e-4'), ('name', 'a=b')]
    """
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OverrideError(f"--set {pair!r}: expected key=value, e.g. --set log_every=1")
        out.append((key.strip(), value.strip()))
    return out


def convert(value: str, annotation: Any, *, key: str) -> Any:
    """Convert the string `value` to `annotation` (a resolved type hint) or raise OverrideError naming `key`.

    Example:
        >>> convert("none", int | None, key="max_steps") is None
        True
    """
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and value.lower() in ("none", "null", ""):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(value, arg, key=key)
            except OverrideError as err:
                errors.append(str(err))
        raise OverrideError(f"--set {key}={value}: does not convert to {annotation} ({'; '.join(errors)})")
    if origin is typing.Literal:
        for arg in args:
            if str(arg) == value:
                return arg
        raise OverrideError(f"--set {key}={value}: allowed values are {', '.join(map(str, args))}")
    if annotation is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise OverrideError(f"--set {key}={value}: expected a boolean (true/false)")
    if annotation is int:
        try:
            return int(value)
        except ValueError:
            try:
                as_float = float(value)  # "1e3" is a fine way to write 1000
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise OverrideError(f"--set {key}={value}: expected an integer") from None
    if annotation is float:
        try:
            return float(value)
        except ValueError:
            raise OverrideError(f"--set {key}={value}: expected a number") from None
    if annotation is str or annotation is Any:
        return value
    if origin in (tuple, list, dict) or annotation in (tuple, list, dict):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            if origin in (tuple, list) or annotation in (tuple, list):
                parsed = [v for v in value.split(",") if v]  # "a,b,c" as a list of strings
            else:
                raise OverrideError(f"--set {key}={value}: expected a JSON object, e.g. '{{\"a\": 1}}'") from None
        if (origin is dict or annotation is dict) and not isinstance(parsed, dict):
            raise OverrideError(f"--set {key}={value}: expected a JSON object")
        if origin is tuple or annotation is tuple:
            if not isinstance(parsed, list):
                parsed = [parsed]
            item_types = [a for a in args if a is not Ellipsis]
            if len(item_types) == 1:
                return tuple(convert(str(v), item_types[0], key=key) for v in parsed)
            return tuple(parsed)
        if origin is list:
            if not isinstance(parsed, list):
                parsed = [parsed]
            if args:
                return [convert(v if isinstance(v, str) else json.dumps(v), args[0], key=key) for v in parsed]
        return parsed
    try:
        return annotation(value)
    except Exception:
        raise OverrideError(f"--set {key}={value}: does not convert to {annotation}") from None


def field_types(config: Any) -> dict[str, Any]:
    """The resolved type of each dataclass field of `config` (an instance or a class)."""
    cls = config if isinstance(config, type) else type(config)
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def apply_overrides(overrides: Sequence[str] | Mapping[str, Any], configs: Mapping[str, Any]) -> dict[str, Any]:
    """Return copies of the dataclass instances in `configs` with the overrides applied: `--set key=value` strings,
    or a mapping of keys to values (a string value is converted with the field's type as `--set` does; any other
    value must already be of that type, which the config's own validation checks).

    Raises OverrideError for an unknown key (listing near matches) or a value of the wrong type; the configs'
    own validation errors (ValueError from `__post_init__`) are re-raised as OverrideError naming the key.

    Example:
        >>> @dataclasses.dataclass
        ... class T:
        ...     lr: float = 1e-3
        ...     log_every: int = 10
        >>> apply_overrides(["log_every=1"], {"train": T()})["train"].log_every
        1
        >>> apply_overrides({"train.lr": 0.01}, {"train": T()})["train"].lr
        0.01
    """
    items = list(overrides.items()) if isinstance(overrides, Mapping) else parse_pairs(overrides)
    types_by_config = {name: field_types(cfg) for name, cfg in configs.items()}
    changes: dict[str, dict[str, Any]] = {name: {} for name in configs}
    keys: dict[str, list[str]] = {name: [] for name in configs}
    for key, value in items:
        for t, name in targets(key, configs, types_by_config):
            annotation = types_by_config[t][name]
            changes[t][name] = convert(value, annotation, key=key) if isinstance(value, str) else value
            keys[t].append(key)
    result = {}
    for name, cfg in configs.items():
        if not changes[name]:
            result[name] = cfg
            continue
        try:
            result[name] = dataclasses.replace(cfg, **changes[name])
        except (ValueError, TypeError) as err:
            raise OverrideError(f"--set {', '.join(keys[name])}: invalid {name} config: {err}") from err
    return result


def targets(
    key: str, configs: Mapping[str, Any], types_by_config: Mapping[str, Mapping[str, Any]] | None = None
) -> list[tuple[str, str]]:
    """(config name, field name) pairs that `key` sets: `section.field` sets that section's field; a bare name sets
    every config that has it. An unknown key is an OverrideError naming our field for another tool's name of the same
    setting (:data:`SYNONYMS`: ``learning_rate`` -> ``lr``), then the near matches by spelling.

    Example:
        >>> @dataclasses.dataclass
        ... class M:
        ...     dropout: float = 0.0
        >>> targets("model.dropout", {"model": M()}), targets("dropout", {"model": M()})
        ([('model', 'dropout')], [('model', 'dropout')])
    """
    types_by_config = types_by_config or {name: field_types(cfg) for name, cfg in configs.items()}
    prefix, dot, bare = key.partition(".")
    sections = [prefix] if dot and prefix in configs else list(configs)
    name = bare if dot and prefix in configs else key
    hit = [(t, name) for t in sections if name in types_by_config[t]]
    if not hit:
        known = sorted({f for t in sections for f in types_by_config[t]})
        near = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
        meant = SYNONYMS.get(name.lower().replace("-", "_"))
        if meant in known:  # by meaning first, then by spelling
            near = [meant, *(n for n in near if n != meant)][:4]
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise OverrideError(
            f"--set {key}: no field {name!r} in the {' or '.join(sections)} config{hint} (known fields: "
            f"{', '.join(known)})"
        )
    return hit
