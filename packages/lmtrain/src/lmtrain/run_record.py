"""run.json, typed: what a run is, written once by the command that trained it and read back through one function.

Every command that trains (`train`, `finetune`) writes a :class:`RunRecord` into its run directory
(:func:`write_run_record`); every command that reads a run (`eval`, `generate`, `export`, `--resume`,
`--init-from`, `train --config RUN/run.json`) reads it with :func:`read_run_record`. Files written before the record
had a format version (no ``"format"`` key) still read: their missing fields take the values those versions meant.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

RUN_FILE = "run.json"
FORMAT = 1  # 0: the files of lmtrain 0.1.0.dev0 before this record (no "format" key)
COMMANDS = ("train", "finetune")
MATMUL_LIBRARIES = ("mkl", "onednn")


@dataclass(frozen=True)
class RunRecord:
    """A run, as run.json holds it. The three configs are kept as JSON objects (``model_config`` of lmcore's
    ModelConfig, ``train_config`` of trainloop's TrainConfig, ``data_config`` of lmtrain's DataConfig); the typed
    configs are :meth:`model`, :meth:`train` and :meth:`data_settings`.

    ``cpu_threads`` and ``cpu_matmul`` are what the run computed with on a CPU (a probe's answer or the user's
    setting): a resumed run, and a run started ``--init-from`` this one, compute with the same, so that the load of
    the machine at a restart cannot change a run's numbers. ``finetune`` and ``chat_template`` are a fine-tune's,
    ``base`` a fine-tune's of a Hugging Face base model (its architecture and config.json, for the export back; its
    chat template is in the tokenizer files the run keeps); ``init_from`` says where a run's first weights came
    from.

    Example:
        >>> record = RunRecord("train", model_config={"n_layer": 2}, train_config={}, data_config={"seq_len": 8})
        >>> RunRecord.from_json(record.to_json(), "run.json") == record, record.seq_len
        (True, 8)
    """

    command: str
    model_config: Mapping[str, Any]
    train_config: Mapping[str, Any]
    data_config: Mapping[str, Any]
    data: str | None = None  # the data the run trained on: a prepared directory, a blend spec, a JSONL file
    recipe: str | None = None
    schedule: str = "config"  # "budget": sized to a time budget while it ran; "config": the TrainConfig's
    plan: Mapping[str, Any] | None = None  # the regularisation the budget planner chose (lmtrain.planner)
    eos_id: int | None = None
    vocab_size: int | None = None
    bytes_per_token: float | None = None
    n_params: int | None = None
    tokenizer_sha256: str | None = None
    world_size: int = 1
    cpu_threads: int | None = None
    cpu_matmul: str | None = None  # "mkl" or "onednn": the library of the fp32 GEMMs on a CPU; None: not on a CPU
    notes: tuple[str, ...] = ()
    init_from: Mapping[str, Any] | None = None
    finetune: Mapping[str, Any] | None = None
    chat_template: Mapping[str, Any] | None = None
    base: Mapping[str, Any] | None = None  # a fine-tune of a Hugging Face base: lmcore's HFSource.to_dict()
    format: int = FORMAT

    @property
    def seq_len(self) -> int:
        """The training context in tokens."""
        return int(self.data_config["seq_len"])

    def model(self) -> Any:
        """The run's lmcore ModelConfig."""
        from lmcore import ModelConfig

        return ModelConfig.from_dict(dict(self.model_config))

    def train(self) -> Any:
        """The run's trainloop TrainConfig."""
        from trainloop import TrainConfig

        return TrainConfig.from_dict(dict(self.train_config))

    def data_settings(self) -> Any:
        """The run's lmtrain DataConfig."""
        from lmtrain.recipes import DataConfig

        return DataConfig(**self.data_config)

    def to_json(self) -> dict[str, Any]:
        """The JSON object run.json holds."""
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_json(cls, value: Any, where: str | os.PathLike) -> RunRecord:
        """The record of a JSON object read from ``where``, of this format or an older one; a field of the wrong
        kind is one LmtrainError naming the file, the field and what it should be."""
        restore = "restore the file the run's command wrote"
        if not isinstance(value, dict):
            raise LmtrainError(f"{where}: expected a JSON object, found {type(value).__name__}; {restore}")
        for key in ("model_config", "train_config", "data_config"):
            if not isinstance(value.get(key), dict):
                found = type(value.get(key)).__name__ if key in value else "nothing"
                raise LmtrainError(f"{where}: expected {key!r} to be an object, found {found}; {restore}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in value.items() if k in known}
        values.setdefault("format", 0)
        values.setdefault("command", "finetune" if isinstance(value.get("finetune"), dict) else "train")
        values["notes"] = tuple(str(n) for n in values.get("notes") or ())
        record = cls(**values)
        _check(record, where, restore)
        return record


def _check(record: RunRecord, where: str | os.PathLike, restore: str) -> None:
    def bad(name: str, expected: str) -> LmtrainError:
        return LmtrainError(f"{where}: {name}={getattr_path(record, name)!r}: expected {expected}; {restore}")

    if record.command not in COMMANDS:
        raise bad("command", f"one of {', '.join(COMMANDS)}")
    seq_len = record.data_config.get("seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise bad("data_config.seq_len", "a positive integer")
    for name in ("eos_id", "vocab_size", "n_params", "cpu_threads"):
        v = getattr(record, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise bad(name, "an integer or null")
    if isinstance(record.world_size, bool) or not isinstance(record.world_size, int) or record.world_size < 1:
        raise bad("world_size", "a positive integer")
    if record.cpu_matmul is not None and record.cpu_matmul not in MATMUL_LIBRARIES:
        raise bad("cpu_matmul", f"one of {', '.join(MATMUL_LIBRARIES)} or null")
    for name in ("plan", "init_from", "finetune", "chat_template", "base"):
        if getattr(record, name) is not None and not isinstance(getattr(record, name), dict):
            raise bad(name, "an object or null")


def getattr_path(record: RunRecord, name: str) -> Any:
    """``record.a.b`` for the dotted ``name`` ``"a.b"`` (dicts by key)."""
    head, _, rest = name.partition(".")
    value = getattr(record, head)
    return value.get(rest) if rest and isinstance(value, Mapping) else value


def read_run_record(run_dir: str | os.PathLike) -> RunRecord:
    """RUN_DIR/run.json as the command that trained the run wrote it; a missing or unreadable file, or one that is
    not such a record, is one LmtrainError naming the file.

    Example (`tiny_run`: 4 steps of the tiny preset):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_run
        >>> work = tempfile.TemporaryDirectory()
        >>> record = read_run_record(tiny_run(work.name))
        >>> record.command, record.recipe, record.seq_len, record.model().n_layer
        ('train', 'tiny', 32, 2)
        >>> work.cleanup()
    """
    from lmtrain.json_files import read_json

    path = Path(run_dir) / RUN_FILE
    return RunRecord.from_json(read_json(path, "written by `lmtrain train` or `lmtrain finetune`"), path)


def write_run_record(run_dir: str | os.PathLike, record: RunRecord) -> None:
    """Write RUN_DIR/run.json atomically (a kill never leaves half a file)."""
    from lmtrain.json_files import write_json_atomic

    write_json_atomic(Path(run_dir) / RUN_FILE, record.to_json())
