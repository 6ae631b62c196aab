"""Starting from a trained run's weights: `lmtrain train --init-from RUN[:CKPT]` and `lmtrain finetune --from`.

The weights of one checkpoint of another run, nothing else of it: the new run gets a fresh optimizer, a fresh
schedule and its own data. The source run must have been trained with the tokenizer the new data was encoded with
(the SHA-256 of its tokenizer.model, recorded in run.json, against the data's). The model config is the source's
(the weights fix its shape); fields that change no shape (dropout, checkpointing, the attention backend) may still
be overridden.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.run_record import RunRecord

_WHICH = re.compile(r"best|latest|\d+")


@dataclass(frozen=True)
class InitSource:
    """A checkpoint of a trained run, resolved: the run, the checkpoint directory, its step, the source's run.json,
    its model config and its weights (fp32 tensors by name)."""

    spec: str
    run_dir: Path
    checkpoint: Path
    step: int | None
    run: RunRecord  # the source run's run.json
    model_config: Mapping[str, Any]
    state: Mapping[str, Any]
    tokenizer_sha256: str | None

    def record(self) -> dict[str, Any]:
        """What run.json keeps of the source: where the weights came from."""
        return {"run": str(self.run_dir.resolve()), "checkpoint": self.checkpoint.name, "step": self.step,
                "tokenizer_sha256": self.tokenizer_sha256}  # fmt: skip


def parse_init_spec(spec: str, flag: str = "--init-from") -> tuple[Path, str | int]:
    """(run directory, which checkpoint) of ``RUN[:best|latest|STEP]``; the checkpoint defaults to ``best``.

    Example:
        >>> parse_init_spec("runs/base:latest"), parse_init_spec("runs/base:1200"), parse_init_spec("runs/base")
        ((PosixPath('runs/base'), 'latest'), (PosixPath('runs/base'), 1200), (PosixPath('runs/base'), 'best'))
    """
    run, sep, which = spec.rpartition(":")
    if not sep or not _WHICH.fullmatch(which) or not run:
        run, which = spec, "best"
    if not run:
        raise LmtrainError(f"{flag} {spec!r}: expected RUN_DIR[:best|latest|STEP], a run written by `lmtrain train`")
    return Path(run), int(which) if which.isdigit() else which


def read_init_source(spec: str, data_tokenizer_sha256: str | None, *, flag: str = "--init-from",
                     verify: str = "sizes") -> InitSource:  # fmt: skip
    """The checkpoint ``spec`` names, its weights read (safetensors, no unpickling), checked against the data's
    tokenizer: a run without checkpoints, with another tokenizer or with unreadable weights is one LmtrainError.

    Example (`tiny_run`: 4 steps of the tiny preset; its own data has the same tokenizer):
        >>> import tempfile
        >>> import tokbin
        >>> from lmtrain.examples import tiny_run
        >>> work = tempfile.TemporaryDirectory()
        >>> run = tiny_run(work.name)
        >>> sha = tokbin.file_sha256(run / "tokenizer.model")
        >>> source = read_init_source(f"{run}:latest", sha)
        >>> source.checkpoint.name, source.step, source.model_config["n_layer"]
        ('step_00000004', 4, 2)
        >>> read_init_source(f"{run}:latest", "0" * 64)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: --init-from .../run:latest: the run was trained with tokenizer sha256 ...
        >>> work.cleanup()
    """
    import tokbin
    from lmtrain.run_files import TOKENIZER_FILE, load_trained_model

    run_dir, which = parse_init_spec(spec, flag)
    if not run_dir.is_dir():
        raise LmtrainError(f"{flag} {spec}: {run_dir} is not a directory: expected a run written by `lmtrain train`")
    try:
        model, run, checkpoint = load_trained_model(run_dir, checkpoint=which, verify=verify, set_threads=False)
    except LmtrainError as exc:
        raise LmtrainError(f"{flag} {spec}: {exc}") from None
    tokenizer = run_dir / TOKENIZER_FILE
    sha = run.tokenizer_sha256 or (tokbin.file_sha256(tokenizer) if tokenizer.is_file() else None)
    if data_tokenizer_sha256 is not None and sha is not None and sha != data_tokenizer_sha256:
        raise LmtrainError(
            f"{flag} {spec}: the run was trained with tokenizer sha256 {sha}, the data was encoded with sha256 "
            f"{data_tokenizer_sha256}: its token ids mean other pieces there; prepare the data with the run's "
            f"tokenizer (`lmtrain prepare --tokenizer {run_dir} ...`), or start from a run trained on this tokenizer"
        )
    step = int(checkpoint.name.rpartition("_")[2]) if checkpoint.name.rpartition("_")[2].isdigit() else None
    config = model.config.to_dict()
    state = dict(model.state_dict())  # fp32, as the checkpoint holds it
    return InitSource(spec, run_dir, checkpoint, step, run, config, state, sha)


def load_init_weights(model: Any, source: InitSource) -> None:
    """Copy the source's weights into ``model`` (built from the planned config) exactly; a shape the plan changed
    (an overridden d_model, n_layer, vocab_size...) is one LmtrainError naming the tensor and the fix."""
    own = model.state_dict()
    for key, tensor in source.state.items():
        if key in own and tuple(own[key].shape) != tuple(tensor.shape):
            raise LmtrainError(
                f"--init-from {source.spec}: {key} is {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(own[key].shape)} in the planned model: drop the --set that changes the model's shape "
                "(the weights fix it)"
            )
    missing, unexpected = model.load_state_dict(dict(source.state), strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight") or not model.config.tie_embeddings]
    if missing or unexpected:
        raise LmtrainError(f"--init-from {source.spec}: weights do not match the planned model (missing "
                           f"{missing[:4]}, unexpected {unexpected[:4]})")  # fmt: skip
