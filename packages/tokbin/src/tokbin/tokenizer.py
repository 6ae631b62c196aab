"""Training and loading SentencePiece tokenizers, and the SHA-256 identity recorded in token files."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from tokbin.errors import TokenFileError
from tokbin.writer import atomic_output, refuse_linked, write_failure

MODEL_TYPES = ("bpe", "unigram", "char", "word")
SPM_MAX_SENTENCE_LENGTH = 4192  # SentencePiece's default: longer lines (in bytes) are left out of training
# TrainerSpec fields (sentencepiece_model.proto) that say where and on how many threads a model was trained, not
# what it is: input (1), model_prefix (2), num_threads (16), seed_sentencepieces_file (54). Kept out of the model.
_MACHINE_FIELDS = frozenset({1, 2, 16, 54})
_TRAINER_SPEC = 2  # ModelProto.trainer_spec


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


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(buf: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(field number, the field's bytes with its key, the payload of a length-delimited field) of a protobuf message."""
    i = 0
    while i < len(buf):
        start = i
        key, i = _varint(buf, i)
        wire, payload = key & 7, b""
        if wire == 0:
            _, i = _varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            n, i = _varint(buf, i)
            payload, i = buf[i : i + n], i + n
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated protobuf message")
        yield key >> 3, buf[start:i], payload


def portable_model(model: bytes) -> bytes:
    """A serialized SentencePiece model without the trainer-spec fields that depend on the machine that trained it.

    SentencePiece records the input paths, the output prefix and the thread count in the model, so one corpus
    trained in two directories gave two files with the same pieces and ids but different bytes (and SHA-256s, the
    identity token files carry). Every other field is kept as it is, in order.
    """
    out = bytearray()
    for number, raw, payload in _fields(model):
        if number == _TRAINER_SPEC and raw[0] & 7 == 2:
            spec = b"".join(r for n, r, _ in _fields(payload) if n not in _MACHINE_FIELDS)
            out += raw[:1] + _encode_varint(len(spec)) + spec  # the key of field 2 is one byte
        else:
            out += raw
    return bytes(out)


def _line_lengths(paths: list[Path]) -> Iterator[np.ndarray]:
    """Byte lengths of the lines of ``paths`` in order (without their newline), in chunks; 1 MiB read at a time."""
    for path in paths:
        carry = 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                if ends.size:
                    starts = np.concatenate([[-1], ends[:-1]])
                    lengths = ends - starts - 1
                    lengths[0] += carry
                    yield lengths
                    carry = len(chunk) - 1 - int(ends[-1])
                else:
                    carry += len(chunk)
        if carry:
            yield np.array([carry])


def _even_lines(paths: list[Path], keep: int, out: Path) -> bool:
    """Write ``keep`` lines of ``paths`` spread evenly over them to ``out`` if they hold more; False if they do not.

    SentencePiece draws its ``input_sentence_size`` sample at random, differently on every run and for every thread
    count (measured: 6 runs over 9442 lines keeping 1000, 6 different models); lines chosen by their position give
    the same model every time.
    """
    total = sum(int(lengths.size) for lengths in _line_lengths(paths))
    if total <= keep:
        return False
    index = 0
    with open(out, "wb") as w:
        for path in paths:
            with open(path, "rb") as f:
                for line in f:
                    # line i is kept when floor(i * keep / total) steps: exactly `keep` of `total`, evenly spaced
                    if (index * keep) // total != ((index + 1) * keep) // total:
                        w.write(line if line.endswith(b"\n") else line + b"\n")
                    index += 1
    return True


def _no_sentences(paths: list[Path], limit: int) -> str:
    """Why SentencePiece found no sentence in ``paths`` (its own message is an internal check)."""
    names = ", ".join(map(str, paths))
    longest = max((int(lengths.max()) for lengths in _line_lengths(paths) if lengths.size), default=0)
    if longest > limit:
        return (
            f"no line of {names} fits max_sentence_length ({limit} bytes; the longest is {longest}): expected "
            "shorter lines; split them, or raise the limit (max_sentence_length=..., --max-sentence-length)"
        )
    return f"no line of {names} to train on: expected text, found only empty lines"


def _run_with_elapsed_bar(fn: Callable[[], None], desc: str) -> None:
    """Run ``fn`` in a thread while a tqdm bar ticks; SentencePiece's trainer releases the GIL, so the bar moves."""
    import threading

    from tokbin.bar import Bar

    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=target, name="spm-train", daemon=True)
    with Bar(desc=desc, bar_format="{desc}: {elapsed} elapsed") as bar:
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
    to the number of CPUs. Where the inputs hold more lines than ``input_sentence_size``, lines spread evenly over
    them are trained on (SentencePiece's own sample is random), and the model written leaves out the input paths,
    the prefix and the thread count, so one corpus gives the same ``.model`` bytes on every run and in any
    directory (for BPE on any thread count too; unigram training sums in thread order). Lines over
    ``max_sentence_length`` bytes (SentencePiece's default 4192) are left out by SentencePiece; if that leaves
    none, the error says so. ``progress`` shows a tqdm elapsed-time bar (SentencePiece reports no fraction done)
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
    model, vocab = (prefix.with_name(prefix.name + suffix) for suffix in (".model", ".vocab"))
    for out in (model, vocab):  # refused before the training, not after it
        refuse_linked(out)
    options = {"num_threads": os.cpu_count() or 1, **({"minloglevel": 1} if progress else {}), **spm_options}
    paths = [Path(p) for p in inputs]
    # SentencePiece writes its outputs itself, through any link in their place: it writes into a directory of ours,
    # and the files are moved into place by atomic_output, which refuses links.
    try:
        private = Path(tempfile.mkdtemp(dir=prefix.parent, prefix=f".{prefix.name}.train-"))
    except OSError as exc:
        raise write_failure(prefix, exc) or exc from None
    try:
        lines = private / "lines.txt"
        keep = int(options.get("input_sentence_size") or 0)
        train_on = [lines] if keep > 0 and _even_lines(paths, keep, lines) else paths
        inner = private / prefix.name
        spec = (vocab_size, model_type, character_coverage, byte_fallback)
        _train(train_on, paths, inner, *spec, progress, options, shown=prefix)
        trained = inner.with_name(inner.name + ".model").read_bytes()
        with atomic_output(model, lock=False) as f:
            f.write(portable_model(trained))
        with atomic_output(vocab, lock=False) as f:
            f.write(inner.with_name(inner.name + ".vocab").read_bytes())
    except OSError as exc:
        raise write_failure(prefix, exc) or exc from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return model


def _train(
    inputs: list[Path],
    named: list[Path],
    prefix: Path,
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    byte_fallback: bool,
    progress: bool,
    options: dict[str, Any],
    *,
    shown: Path,
) -> None:
    """SentencePiece's training into ``prefix``; its errors name ``shown``, the prefix the caller asked for."""

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
            _run_with_elapsed_bar(run, f"train-tokenizer {shown.name}")
        else:
            run()
    except (RuntimeError, OSError) as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "!sentences_.empty()" in message:  # SentencePiece's internal checks, said in the input's terms
            message = _no_sentences(named, int(options.get("max_sentence_length", SPM_MAX_SENTENCE_LENGTH)))
        elif "(all_chars_count) > (0)" in message:
            message = f"no character of {', '.join(map(str, named))} to train on: expected text, found only spaces"
        raise TokenFileError(shown, f"SentencePiece training failed: {message}") from None
