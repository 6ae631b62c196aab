"""What a run directory holds and how the other commands read it back.

RUN_DIR/
    run.json            the model config, the data and training settings, the tokenizer's identity
    tokenizer.model     a copy of the data's tokenizer, so a run evaluates and generates on its own
    metrics.jsonl       one record per logged step (trainloop)
    checkpoints/...     trainloop's checkpoints (latest_checkpoint() finds the newest complete one)
    loss.png            the curves
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.json_files import read_json
from lmtrain.run_record import RunRecord, read_run_record

TOKENIZER_FILE = "tokenizer.model"
META_FILE = "meta.json"


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """DATA_DIR/meta.json as written by `lmtrain prepare`, with paths resolved against DATA_DIR.

    Every path must stay inside DATA_DIR, and the tokenizer must be the one the token files were encoded with
    (its SHA-256 equals the one in their headers): anything else raises LmtrainError naming the file.
    """
    import tokbin

    data = Path(data_dir)
    where = data / META_FILE
    meta = read_json(where, "written by `lmtrain prepare`")
    if isinstance(meta, dict):
        check_meta_numbers(meta, where)
    if not isinstance(meta, dict):
        raise LmtrainError(f"{where}: expected a JSON object, found {type(meta).__name__}; re-run `lmtrain prepare`")
    for key in ("tokenizer", "train", "val"):
        if key not in meta:
            raise LmtrainError(f"{where}: no {key!r} entry; re-run `lmtrain prepare`")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise LmtrainError(f"{where}: vocab_size must be a positive integer, found {vocab!r}; re-run `lmtrain prepare`")
    root = data.resolve()

    def inside(value: Any, what: str) -> Path:
        if not isinstance(value, str) or not value:
            raise LmtrainError(f"{where}: {what}: expected a path relative to {data}, found {value!r}")
        path = data / value
        if Path(value).is_absolute() or not path.resolve().is_relative_to(root):
            raise LmtrainError(f"{where}: {what} {value!r} leaves the data directory: expected a path inside {data}")
        return path

    tokenizer = inside(meta["tokenizer"], "tokenizer")
    meta["tokenizer_path"] = str(tokenizer)
    for split in ("train", "val"):
        entry = meta[split]
        meta[f"{split}_path"] = str(inside(entry.get("file") if isinstance(entry, dict) else None, f"{split} file"))
    sha = None
    for split in ("train", "val"):
        try:
            recorded = tokbin.open_tokens(meta[f"{split}_path"]).tokenizer_sha256
        except tokbin.TokenFileError as exc:
            raise LmtrainError(f"{exc} (the {split} split of {where})") from None
        if recorded is None:
            continue  # written without a tokenizer identity (tokbin.write_tokens): nothing to compare
        if sha is None:
            if not tokenizer.is_file():
                raise LmtrainError(f"{tokenizer}: missing (the tokenizer written by `lmtrain prepare`)")
            sha = tokbin.file_sha256(tokenizer)
        if recorded != sha:
            raise LmtrainError(
                f"{meta[f'{split}_path']}: encoded with a tokenizer of sha256 {recorded}, but {tokenizer} has "
                f"sha256 {sha}: expected the same tokenizer; re-run `lmtrain prepare`"
            )
    return meta


def check_host_memory(config: Any, weights: Path, where: Path) -> None:
    """Refuse, before anything is allocated, a model whose loading would not fit in the host's available memory:
    the fp32 model `GPT(config)` builds (4 bytes per parameter, lmcore's closed-form count) plus the weights file
    read into memory. A config.json asking for 2000 layers otherwise takes the machine's memory until the kernel
    kills the process."""
    import psutil

    from lmcore import n_params

    count = n_params(config)
    need = 4 * count + (weights.stat().st_size if weights.is_file() else 0)
    available = psutil.virtual_memory().available
    if need > available:
        raise LmtrainError(
            f"{where}: its model config ({count / 1e9:,.2f}B parameters: n_layer={config.n_layer}, "
            f"d_model={config.d_model}, vocab_size={config.vocab_size}) takes about {need / 2**30:,.1f} GiB of host "
            f"memory to load, {available / 2**30:,.1f} GiB is available: if the config is not the one the run "
            "trained, restore it; else load it on a machine with more memory"
        )


def load_trained_model(
    run_dir: str | os.PathLike,
    map_location: str = "cpu",
    *,
    checkpoint: str | int = "latest",
    verify: str = "sizes",
    dtype: Any = None,
    on_note: Callable[[str], None] | None = None,
    set_threads: bool = True,
) -> tuple[Any, RunRecord, Path]:
    """(GPT in eval mode with a checkpoint's weights, the run's record (run.json), checkpoint path).

    `checkpoint`: "latest" (newest complete), "best" (best evaluation; the latest when the run has none), a step
    or a checkpoint directory, as trainloop's `CheckpointStore.resolve` takes it, checked as `verify` says ("sizes":
    every file present with its recorded size; "full": also every file's SHA-256). `on_note` receives each note on
    what was skipped or fallen back from (e.g. "no evaluated best checkpoint in this run; using the latest").
    `dtype` (a torch dtype) casts the weights after loading; None keeps the checkpoint's (fp32). On a CPU,
    `set_threads` sets the threads the model runs with (lmtrain.probes.set_inference_threads: the count the run
    trained with, else a cached or probed one).

    Example (`tiny_run`: 4 steps of the tiny preset on a little of the standard library's source):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_run
        >>> work = tempfile.TemporaryDirectory()
        >>> run_dir = tiny_run(work.name)
        >>> import json
        >>> notes = []
        >>> model, run, checkpoint = load_trained_model(run_dir, checkpoint="best", on_note=notes.append)
        >>> type(model).__name__, model.training, run.vocab_size
        ('GPT', False, 400)
        >>> checkpoint.name == json.loads((run_dir / "checkpoints" / "best.json").read_text())["checkpoint"]
        True
        >>> work.cleanup()
    """
    from lmcore.pretrained import read_config
    from trainloop.checkpoint import MODEL_FILE, CheckpointError, CheckpointStore

    run = read_run_record(run_dir)
    try:
        path, notes = CheckpointStore(run_dir).resolve(checkpoint, verify)
    except CheckpointError as exc:
        raise LmtrainError(str(exc)) from None
    for note in notes:
        if on_note is not None:
            on_note(note)
    check_tokenizer_of(run_dir, path, run.tokenizer_sha256)
    own_config = (path / "config.json").is_file()
    try:
        config = read_config(path) if own_config else run.model()
    except (ValueError, TypeError) as exc:  # read_config names its file
        where = f"{path}: unusable checkpoint" if own_config else f"{Path(run_dir) / 'run.json'}: model_config"
        raise LmtrainError(f"{where}: {exc}") from None
    check_host_memory(config, path / MODEL_FILE, path)
    model = model_of_checkpoint(path) if own_config else model_from_weights(path, config)
    import torch

    from lmtrain.model_setup import check_attention_backend

    check_attention_backend(model.config, torch.device(map_location))
    model.to(device=map_location, dtype=dtype).eval()
    if set_threads and torch.device(map_location).type == "cpu":
        from lmtrain.probes import ProbeCache, set_inference_matmuls, set_inference_threads

        set_inference_threads(model, run, cache=ProbeCache())
        set_inference_matmuls(run)
    return model, run, path


def model_of_checkpoint(path: Path) -> Any:
    """The GPT of a checkpoint in lmcore's own layout (save_pretrained): its config, its weights, adapters included."""
    from lmcore import GPT

    try:
        return GPT.from_pretrained(path)
    except (ValueError, OSError) as exc:
        raise LmtrainError(f"{path}: unusable checkpoint: {exc}") from None


def model_from_weights(path: Path, config: Any) -> Any:
    """A GPT of ``config`` holding the checkpoint's weights; a tensor of another shape or kind, a missing or an
    unexpected one is one LmtrainError naming the file and the tensor."""
    from safetensors import SafetensorError

    from lmcore import GPT
    from trainloop.checkpoint import MODEL_FILE, load_model_weights

    try:
        state = load_model_weights(path)
    except (SafetensorError, OSError) as exc:
        raise LmtrainError(f"{path}: unusable checkpoint: {path / MODEL_FILE}: {exc}") from None
    model = GPT(config)
    # Checkpoints written through a wrapper (DDP, DeepSpeed, torch.compile) may prefix the names.
    state = {_strip_prefix(k): v for k, v in state.items()}
    own = model.state_dict()
    for key, tensor in state.items():
        floating = own[key].is_floating_point() if key in own else True
        if key in own and (tensor.shape != own[key].shape or (floating and not tensor.is_floating_point())):
            raise LmtrainError(
                f"{path / MODEL_FILE}: {key} is {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}, "
                f"the run's model config has {str(own[key].dtype).removeprefix('torch.')} {tuple(own[key].shape)}"
            )
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied output head has no tensor of its own in some formats.
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise LmtrainError(
            f"{path}: weights do not match the run's model config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return model


def check_tokenizer_of(run_dir: str | os.PathLike, checkpoint: Path, run_sha256: str | None = None) -> None:
    """Refuse, in one line naming both hashes, a run whose tokenizer is not the one the checkpoint's weights were
    trained with: the record in the checkpoint's extra_state.json (written by every training command), else run.json's
    ``run_sha256``; a run with neither (older runs) passes. The tokenizer is the run's tokenizer.json (a fine-tune of a
    Hugging Face base) or its tokenizer.model."""
    import tokbin

    recorded = None
    with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        recorded = json.loads((checkpoint / "extra_state.json").read_text()).get("tokenizer_sha256")
    recorded = recorded or run_sha256
    base_tokenizer = Path(run_dir) / "tokenizer.json"
    tokenizer = base_tokenizer if base_tokenizer.is_file() else Path(run_dir) / TOKENIZER_FILE
    if recorded is None or not tokenizer.is_file():
        return
    actual = tokbin.file_sha256(tokenizer)
    if actual != recorded:
        source = "the base model's directory" if tokenizer == base_tokenizer else "the data directory it was trained on"
        raise LmtrainError(
            f"{tokenizer} (sha256 {actual}) is not the tokenizer {checkpoint.name} was trained with (sha256 "
            f"{recorded}): restore the run's own {tokenizer.name} ({source} has it)"
        )


def _strip_prefix(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def load_tokenizer(run_dir: str | os.PathLike) -> Any:
    """The run's tokenizer: its SentencePiece processor, or for a fine-tune of a base model the base's tokenizer
    (tokbin's HFTokenizer over the tokenizer.json the run keeps)."""
    import sentencepiece as spm

    if (Path(run_dir) / "tokenizer.json").is_file():
        import tokbin

        try:
            return tokbin.load_tokenizer(Path(run_dir))
        except tokbin.TokenFileError as exc:
            raise LmtrainError(str(exc)) from None
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise LmtrainError(f"{path}: missing (the run's copy of the tokenizer, written by `lmtrain train`)")
    return spm.SentencePieceProcessor(model_file=str(path))


def check_meta_numbers(meta: dict[str, Any], where: str | os.PathLike) -> None:
    """Refuse, in one line, a meta.json whose figures are not what `lmtrain prepare` writes: ``bytes_per_token``
    (top level, ``train`` and ``val``) a finite number > 0, ``tokens`` and ``documents`` of each split integers >= 0.
    What reads meta.json calls it before using them (bits per byte divide by bytes_per_token).

    Example:
        >>> check_meta_numbers({"bytes_per_token": 3.1, "train": {"bytes_per_token": 3.1}, "val": {}}, "meta.json")
        >>> check_meta_numbers({"bytes_per_token": "x"}, "data/meta.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: data/meta.json: bytes_per_token: expected a finite number > 0, found 'x'; ...
    """
    fix = "re-run `lmtrain prepare`"
    places: list[tuple[str, Any]] = [("", meta)]
    places += [(f"{split}.", meta[split]) for split in ("train", "val") if isinstance(meta.get(split), dict)]
    for prefix, section in places:
        value = section.get("bytes_per_token")
        if "bytes_per_token" in section and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            found = f"expected a finite number > 0, found {value!r}"
            raise LmtrainError(f"{where}: {prefix}bytes_per_token: {found}; {fix}")
        for key in ("tokens", "documents") if prefix else ():
            count = section.get(key)
            if key in section and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise LmtrainError(f"{where}: {prefix}{key}: expected an integer >= 0, found {count!r}; {fix}")
