"""Training and loading SentencePiece tokenizers, and the SHA-256 identity recorded in token files."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sentencepiece as spm

from tokbin.errors import TokenFileError

MODEL_TYPES = ("bpe", "unigram", "char", "word")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes: the tokenizer identity stored in every token file header."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError:
        raise TokenFileError(path, "no such file: expected a SentencePiece .model file") from None
    return h.hexdigest()


def load_processor(tokenizer: str | os.PathLike | spm.SentencePieceProcessor) -> spm.SentencePieceProcessor:
    """A SentencePieceProcessor from a ``.model`` path (or the processor itself, passed through)."""
    if isinstance(tokenizer, spm.SentencePieceProcessor):
        return tokenizer
    path = Path(tokenizer)
    if not path.is_file():
        raise TokenFileError(path, "no such file: expected a SentencePiece .model file")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise TokenFileError(path, f"not a SentencePiece model: {str(e).strip().splitlines()[-1]}") from None
    return sp


def _run_with_elapsed_bar(fn: Callable[[], None], desc: str) -> None:
    """Run ``fn`` in a thread while a tqdm bar ticks; SentencePiece's trainer releases the GIL, so the bar moves."""
    import threading

    from tqdm import tqdm

    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=target, name="spm-train", daemon=True)
    with tqdm(desc=desc, bar_format="{desc}: {elapsed} elapsed") as bar:
        thread.start()
        while thread.is_alive():
            thread.join(0.25)
            bar.refresh()
    if errors:
        raise errors[0]


def train_tokenizer(
    inputs: list[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    byte_fallback: bool = False,
    progress: bool = False,
    **spm_options: Any,
) -> Path:
    """Train a SentencePiece model on text files and return the path of ``<model_prefix>.model``.

    ``spm_options`` go to ``SentencePieceTrainer.train`` unchanged (e.g. ``user_defined_symbols=["<|user|>"]``,
    ``input_sentence_size``, ``normalization_rule_name="identity"``, ``minloglevel=2``). ``num_threads`` defaults
    to the number of CPUs. ``progress`` shows a tqdm elapsed-time bar (SentencePiece reports no fraction done)
    and turns SentencePiece's own log down to warnings unless ``minloglevel`` is given. For byte-exact round
    trips (code, whitespace) combine ``byte_fallback=True`` with ``normalization_rule_name="identity"``,
    ``add_dummy_prefix=False`` and ``remove_extra_whitespaces=False``.

    Example::

        model = train_tokenizer(["corpus.txt"], "out/spm", 32000)  # BPE, coverage 0.9995: the 1.3B recipe
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4 (room for unk, bos, eos and one piece), got {vocab_size}")
    if not 0 < character_coverage <= 1:
        raise ValueError(f"character_coverage must be in (0, 1], got {character_coverage}")
    if not inputs:
        raise ValueError("inputs: expected at least one text file, got none")
    for p in inputs:
        if not Path(p).is_file():
            raise TokenFileError(p, "no such file: expected a text file to train on")
        if Path(p).stat().st_size == 0:
            raise TokenFileError(p, "empty input: expected text to train on, found 0 bytes")
    prefix = Path(model_prefix)
    if not prefix.parent.is_dir():
        raise TokenFileError(prefix, f"output directory {prefix.parent} does not exist")
    options = {"num_threads": os.cpu_count() or 1, **({"minloglevel": 1} if progress else {}), **spm_options}

    def run() -> None:
        spm.SentencePieceTrainer.train(
            input=[str(p) for p in inputs],
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            **options,
        )

    try:
        if progress:
            _run_with_elapsed_bar(run, f"train-tokenizer {prefix.name}")
        else:
            run()
    except (RuntimeError, OSError) as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise TokenFileError(prefix, f"SentencePiece training failed: {message}") from None
    return prefix.with_name(prefix.name + ".model")
