"""The pretraining recipe's plan: `lmtrain train` on token files, from a recipe or a model config file.

:func:`plan_run` turns a :class:`TrainRequest` (the recipe, a model config file, overrides, the DeepSpeed JSON, the
budget), a :class:`DataInfo` (the prepared data, the run being resumed, the run --init-from names) and a
:class:`~lmtrain.run_plan.World` into a frozen :class:`~lmtrain.run_plan.RunPlan`: this module says where the
configs start (the recipe table, the config file, the source run's weights) and what the token files require of
them; lmtrain.run_plan.settle decides the rest as it does for every recipe. :func:`train_record` is the run.json of
the plan.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.recipes import DEFAULT_RECIPE, RECIPES, DataConfig, recipe_matching, recipe_named
from lmtrain.run_plan import Base, RunPlan, Verify, World, check_run_options, saved_base, settle
from lmtrain.run_record import RunRecord

__all__ = ["DataInfo", "RunPlan", "TrainRequest", "World", "plan_run", "train_record"]


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
    next_commands: bool = True  # the closing block lists the commands to run next (the demo prints its own)
    force: bool = False  # start even past the estimated host memory (lmtrain.scaffold.check_host_memory)

    def __post_init__(self) -> None:
        if self.recipe is not None and self.model_config is not None:
            raise LmtrainError("give a recipe (--preset) or a model config file (--model-config), not both")
        if self.init_from is not None and self.model_config is not None:
            raise LmtrainError("--init-from takes the model config of the run it starts from: drop --model-config")
        check_run_options(self)

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
    tokens, the record of the run being resumed (None for a new run), the tokenizer's SHA-256, and the run
    --init-from names (``{"model_config": ..., "record": ..., "recipe": ...}``)."""

    meta: Mapping[str, Any]
    train_tokens: int
    saved_run: RunRecord | None = None
    tokenizer_sha256: str | None = None  # of the data directory's tokenizer.model
    init_from: Mapping[str, Any] | None = None


def plan_run(request: TrainRequest, data: DataInfo, world: World) -> RunPlan:
    """The plan of ``request`` on ``data`` in ``world`` (see the module docstring); a bad request is one
    LmtrainError naming the value and the fix.

    Example (a tiny data directory and a run sized to 60 s on one CPU process whose step was timed at 0.05 s):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_data
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
    saved = data.saved_run if request.resume else None
    if saved is not None:
        asked = request.recipe or request.model_config
        flag = f"{'--preset' if request.recipe else '--model-config'} {asked}" if asked else None
        base = saved_base(saved, str(Path(request.out) / "run.json"), flag)
    else:
        base = _fresh_base(request, data)
    meta = data.meta
    values = dict(base.values)
    if request.document_attention:
        if any(k.rpartition(".")[2] == "document_separator" for k in request.overrides):
            raise LmtrainError("--document-attention and --set document_separator=... both set the separator; use one")
        values["model.document_separator"] = document_separator_of(meta["train_path"])

    def check(model_cfg: Any, train_cfg: Any, data_cfg: DataConfig) -> None:
        if model_cfg.vocab_size < meta["vocab_size"]:
            raise LmtrainError(
                f"model vocab_size={model_cfg.vocab_size} < the tokenizer's {meta['vocab_size']}: token ids would "
                "index past the embedding table"
            )
        _check_token_counts(request, meta, data, data_cfg.seq_len or model_cfg.context_length)
        if request.blend_spec is not None and data_cfg.sampler != "random":
            raise LmtrainError(f"--data {request.blend_spec}: a blend draws its windows at random by weight; drop "
                               f"--set sampler={data_cfg.sampler}")  # fmt: skip

    base = dataclasses.replace(base, values=values, check=check, regularise_tokens=data.train_tokens)
    return settle(request, base, world, saved)


def _fresh_base(request: TrainRequest, data: DataInfo) -> Base:
    """The configs a new run starts from: the recipe's or the config file's, or the --init-from source's model with
    the recipe's (or the source recipe's) training and data settings."""
    from lmcore import ModelConfig
    from trainloop import TrainConfig

    meta, notes = data.meta, []
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
    init = data.init_from
    if init is not None:
        # The weights fix the shape: the source run's model config; the training and data settings of --preset, or
        # else of the source run's recipe.
        model_cfg = ModelConfig.from_dict(dict(init["model_config"]))
        if request.recipe is None and init.get("recipe") in RECIPES:
            recipe = str(init["recipe"])
            train_cfg, data_cfg = RECIPES[recipe].train_config(), RECIPES[recipe].data_config()
        notes.append(f"weights from {init['record']['run']} ({init['record']['checkpoint']}): its model config, a "
                     "fresh optimizer and schedule")  # fmt: skip
    return Base(model_cfg, train_cfg, data_cfg, recipe=recipe, notes=tuple(notes),
                explicit_config=request.model_config is not None)  # fmt: skip


def train_record(plan: RunPlan, data: DataInfo, cpu_matmul: str | None = None) -> RunRecord:
    """run.json of a pretraining run: the plan with the data's identity; a resumed run keeps what it started with,
    its world size, training config and notes new."""
    from lmcore import n_params

    if plan.resumed and plan.saved is not None:
        return dataclasses.replace(plan.saved, world_size=plan.world.world_size, train_config=plan.train.to_dict(),
                                   notes=plan.notes, cpu_matmul=plan.saved.cpu_matmul or cpu_matmul)  # fmt: skip
    meta, request = data.meta, plan.request
    return RunRecord(
        command="train",
        data=str(Path(request.data).resolve()),
        recipe=plan.recipe,
        schedule="budget" if plan.budgeted else "config",
        plan=dict(plan.regularisation) if plan.regularisation is not None else None,
        model_config=plan.model.to_dict(),
        train_config=plan.train.to_dict(),
        data_config=dataclasses.asdict(plan.data),
        eos_id=meta.get("eos_id"),
        vocab_size=meta["vocab_size"],
        bytes_per_token=meta["bytes_per_token"],
        n_params=n_params(plan.model),
        tokenizer_sha256=data.tokenizer_sha256,
        world_size=plan.world.world_size,
        cpu_threads=plan.cpu_threads if plan.cpu_threads is not None else plan.world.threads_now,
        cpu_matmul=cpu_matmul,
        notes=plan.notes,
        init_from=dict(data.init_from["record"]) if data.init_from is not None else None,
    )


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


def document_separator_of(token_file: str) -> int:
    """The EOS id that tokbin wrote after each document of `token_file` (what --document-attention uses).

    Example (`tiny_data`: a little of the standard library's source, prepared):
        >>> import tempfile
        >>> import numpy as np
        >>> import tokbin
        >>> from lmtrain.examples import tiny_data
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
