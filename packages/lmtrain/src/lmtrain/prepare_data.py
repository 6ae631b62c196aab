"""`lmtrain prepare`: a corpus of any size -> tokenizer + train/val token files + meta.json.

Memory stays flat: the tokenizer trains on a bounded sample spread over the training corpus, the held-out split is
decided per document by a hash of its text (no copy or join of the corpus), and tokbin encodes in pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lmtrain.errors import WRITE_ERRNOS, LmtrainError, write_failure_message
from lmtrain.json_files import copy_file, write_json_atomic
from lmtrain.recipes import DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE
from lmtrain.run_files import META_FILE, TOKENIZER_FILE

DEFAULT_SAMPLE_MB = 200.0  # text the tokenizer trains on; SentencePiece then keeps at most input_sentence_size lines
VAL_TEXT_FILE = "val.txt"
VAL_TEXT_BYTES = 1 << 20  # the start of the held-out text, decoded, for `lmtrain eval --text`


def _split_info(result: Any, sources: list[str], name: str) -> dict[str, Any]:
    tokens = result.tokens
    return {
        "file": name,
        "sources": sources,
        "tokens": int(tokens.n_tokens),
        "documents": int(tokens.n_docs),
        "bytes": int(result.text_bytes),
        "bytes_per_token": result.text_bytes / max(1, int(tokens.n_tokens)),
        "skipped_lines": int(result.skipped_lines),
    }


def _write_val_text(sp_path: Path, val: Any, out: Path) -> None:
    """The first documents of the validation split, decoded (the tokenizer is lossless), up to VAL_TEXT_BYTES."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_path))
    eos, parts, size = val.eos_id, [], 0
    for i in range(val.n_docs):
        ids = [int(t) for t in val.document(i) if int(t) != eos]
        text = sp.decode(ids)
        parts.append(text)
        size += len(text.encode("utf-8"))
        if size >= VAL_TEXT_BYTES:
            break
    from tokbin.writer import atomic_output

    with atomic_output(out, lock=False) as f:  # never through a link in its place
        f.write("\n\n".join(parts).encode("utf-8"))


_FORMAT_FLAGS = {"jsonl": "--jsonl-field FIELD", "parquet": "--parquet-column COLUMN"}


def input_format(path: str | os.PathLike) -> str:
    """ "jsonl", "parquet" or "text", from the file name (a .gz/.zst suffix left aside).

    Example:
        >>> input_format("corpus.jsonl.gz"), input_format("rows.parquet"), input_format("notes.txt")
        ('jsonl', 'parquet', 'text')
    """
    name = Path(path).name.lower()
    for suffix in (".gz", ".zst", ".zstd"):
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def _first_record_fields(path: Path) -> list[str] | None:
    """The field names of a JSONL file's first record, or None when it cannot be read cheaply as one."""
    import gzip

    if path.suffix.lower() not in ("", ".jsonl", ".json", ".ndjson", ".gz"):
        return None
    try:
        with gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb") as f:
            record = json.loads(f.readline(1 << 20))
    except (OSError, ValueError, EOFError):
        return None
    return sorted(record) if isinstance(record, dict) else None


def check_formats(inputs: list[str | os.PathLike], flag: str, *, jsonl_field: str | None,
                  parquet_column: str | None) -> None:  # fmt: skip
    """Refuse, before any work, plain-text reading of inputs whose names say JSONL or Parquet: they would be encoded
    as text (their JSON syntax and all) and the mistake seen only at the end."""
    from tokbin import TokenFileError
    from tokbin.sources import expand_inputs

    if jsonl_field is not None or parquet_column is not None:
        return
    try:
        paths = expand_inputs(list(inputs))
    except TokenFileError:
        return  # tokbin's own one line comes when the inputs are read
    for path in paths:
        fmt = input_format(path)
        if fmt == "text":
            continue
        hint = ""
        fields = _first_record_fields(path) if fmt == "jsonl" else None
        if fields:
            field = "text" if "text" in fields else fields[0]
            hint = f" (its first record has the fields {', '.join(fields)}): add --jsonl-field {field}"
        raise LmtrainError(
            f"{flag} {path}: looks like {'JSONL' if fmt == 'jsonl' else 'Parquet'} by its name, but it would be read "
            f"as plain text{hint or ': add ' + _FORMAT_FLAGS[fmt]}, or rename the file if it is plain text"
        )


def prepare(
    texts: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    val_texts: list[str | os.PathLike] | None = None,
    val_fraction: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    progress: bool = True,
    jsonl_field: str | None = None,
    parquet_column: str | None = None,
    split_docs: bool = False,
    workers: int | None = None,
    sample_mb: float = DEFAULT_SAMPLE_MB,
    shard_mb: float | None = None,
    skip_bad_lines: bool = False,
    clean: bool = False,
    tokenizer: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Train the tokenizer on a sample of the training corpus, encode both splits, write and return meta.json.

    ``tokenizer`` (a run directory, or a SentencePiece ``.model`` file) encodes with that tokenizer instead of
    training one: the data then continue a run of it (`lmtrain train --init-from RUN`).

    Inputs are files, directories or globs of plain text, JSONL (``jsonl_field``) or Parquet (``parquet_column``).
    Without ``val_texts``, ``val_fraction`` of the documents (default 0.1) is held out by a hash of each document's
    text; plain text is then cut into documents at blank lines. ``shard_mb`` writes each split as a resumable shard
    directory instead of one file.

    Example (a little of the standard library's Python source as the corpus):
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from lmtrain.corpus import build_corpus
        >>> work = tempfile.TemporaryDirectory()
        >>> _ = build_corpus(Path(work.name) / "input.txt", 100_000)
        >>> meta = prepare([Path(work.name) / "input.txt"], Path(work.name) / "data", vocab_size=400, progress=False)
        >>> meta["vocab_size"], meta["split"], meta["train"]["file"], meta["val"]["file"]
        (400, {'by': 'document hash', 'val_fraction': 0.1}, 'train.bin', 'val.bin')
        >>> held_out = meta["val"]["tokens"] / (meta["train"]["tokens"] + meta["val"]["tokens"])
        >>> 0.05 < held_out < 0.2, 1 < meta["train"]["bytes_per_token"] < 4  # about a tenth of the documents
        (True, True)
        >>> sorted(os.listdir(Path(work.name) / "data"))  # doctest: +ELLIPSIS
        ['meta.json', 'tokenizer.model', ..., 'train.bin', ..., 'val.bin', ..., 'val.txt']
        >>> work.cleanup()
    """
    if vocab_size < 4:
        raise LmtrainError(f"--vocab-size must be >= 4 (unk, bos, eos and one piece), got {vocab_size}")
    if not math.isfinite(sample_mb) or sample_mb <= 0:
        raise LmtrainError(f"--tokenizer-sample-mb must be a finite number > 0, got {sample_mb}")
    if shard_mb is not None and (not math.isfinite(shard_mb) or shard_mb <= 0):
        raise LmtrainError(f"--shard-mb must be a finite number > 0, got {shard_mb}")
    if workers is not None and workers < 1:
        raise LmtrainError(f"--workers must be >= 1, got {workers}")
    if val_texts and val_fraction is not None:
        raise LmtrainError("--val-text and --val-fraction: expected one way to hold out validation text, got both")
    fraction = None if val_texts else (DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction)
    if fraction is not None and not 0 < fraction < 1:
        raise LmtrainError(f"--val-fraction must be in (0, 1), got {fraction}")
    fmt_text = jsonl_field is None and parquet_column is None
    read: dict[str, Any] = {
        "jsonl_field": jsonl_field,
        "parquet_column": parquet_column,
        # the held-out unit is the document: plain text is cut at blank lines so there are documents to hold out
        "split_docs": fmt_text and (split_docs or fraction is not None),
        "skip_bad_lines": skip_bad_lines,
        "clean": clean,  # tokbin's cleaning (HTML tags, bracketed citation marks, runs of whitespace), sample too
    }
    check_formats(texts, "--text", jsonl_field=jsonl_field, parquet_column=parquet_column)
    if val_texts:
        check_formats(val_texts, "--val-text", jsonl_field=jsonl_field, parquet_column=parquet_column)
    source = None if tokenizer is None else tokenizer_source(tokenizer)
    out = Path(out_dir)
    _refuse_linked_outputs(out, shard_mb is not None)
    # A failed prepare leaves no partial output: what it added is removed (a shard directory is kept: rerun resumes).
    found = set(os.listdir(out)) if out.is_dir() else None
    try:
        return _prepare(texts, out, val_texts, fraction, vocab_size, model_type, read, fmt_text, split_docs,
                        workers, progress, sample_mb, shard_mb, source)  # fmt: skip
    except BaseException as exc:
        if shard_mb is None:
            _remove_new(out, found)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:  # a full disk, the file size limit, read-only
            raise LmtrainError(write_failure_message(exc, str(out))) from None
        raise


def _refuse_linked_outputs(out: Path, sharded: bool) -> None:
    """Refuse, before any work, an output of prepare that is a symbolic or hard link in ``out`` (each writer refuses
    its own too, but only once its turn comes: after the tokenizer has trained)."""
    from tokbin import TokenFileError
    from tokbin.writer import refuse_linked

    names = [TOKENIZER_FILE, Path(TOKENIZER_FILE).with_suffix(".vocab").name, META_FILE, VAL_TEXT_FILE]
    names += [] if sharded else ["train.bin", "val.bin"]
    for name in names:
        try:
            refuse_linked(out / name)
        except TokenFileError as exc:
            raise LmtrainError(str(exc)) from None


def _remove_new(out: Path, found: set[str] | None) -> None:
    from lmtrain.run_lock import LOCK_FILE

    if not out.is_dir():
        return
    for name in set(os.listdir(out)) - (found or set()) - {LOCK_FILE}:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if found is None:
        with contextlib.suppress(OSError):
            out.rmdir()  # made here and now empty


def _prepare(
    texts: list[str | os.PathLike],
    out: Path,
    val_texts: list[str | os.PathLike] | None,
    fraction: float | None,
    vocab_size: int,
    model_type: str,
    read: dict[str, Any],
    fmt_text: bool,
    split_docs: bool,
    workers: int | None,
    progress: bool,
    sample_mb: float,
    shard_mb: float | None,
    source: Path | None = None,
) -> dict[str, Any]:
    import tokbin
    from lmtrain.progress import step

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_split = val_split = None
    if fraction is not None:
        train_split, val_split = tokbin.HashSplit(fraction, "train"), tokbin.HashSplit(fraction, "val")
    sample = out / ".tokenizer_sample.txt"
    sample_bytes = 0
    try:
        if source is not None:
            copy_file(source, out / TOKENIZER_FILE)  # the given tokenizer, byte for byte: the same sha256
        else:
            sample_bytes = _train_tokenizer(texts, out, sample, sample_mb, vocab_size, model_type, read, train_split,
                                            progress)  # fmt: skip
        tokenizer = out / TOKENIZER_FILE
        names = ("train", "val") if shard_mb is not None else ("train.bin", "val.bin")
        options = dict(read, workers=workers)
        if shard_mb is not None:
            options["shard_bytes"] = max(1, int(shard_mb * 1e6))
        # The validation split first: usually the smaller one, and the one a held-out fraction of few documents
        # leaves empty most often, which then fails before the long encoding of the training split, not after it.
        val_inputs = val_texts or texts
        val_options = {**options, "split_docs": fmt_text and split_docs} if val_texts else options
        with step(f"encode: the validation split -> {out / names[1]}", enabled=progress) as bar:
            val = tokbin.encode_inputs(tokenizer, val_inputs, out / names[1], hash_split=val_split, progress=bar,
                                       **val_options)  # fmt: skip
        with step(f"encode: the training split -> {out / names[0]}", enabled=progress) as bar:
            train = tokbin.encode_inputs(tokenizer, texts, out / names[0], hash_split=train_split, progress=bar,
                                         **options)  # fmt: skip
        val_text = out / VAL_TEXT_FILE
        if not any(Path(v).resolve() == val_text.resolve() for v in val_inputs):  # never overwrite an input
            _write_val_text(tokenizer, val.tokens, val_text)
    except tokbin.TokenFileError as exc:
        if "no tokens to write" in str(exc) and fraction is not None:
            raise LmtrainError(
                f"{exc}: --val-fraction {fraction} left a split without documents; use more text, another "
                "fraction, or --val-text"
            ) from None
        raise LmtrainError(str(exc)) from None  # a missing pyarrow: tokbin's line names the command that installs it
    except ValueError as exc:
        raise LmtrainError(str(exc)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            sample.unlink()
    meta = {
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokbin.file_sha256(tokenizer),
        "tokenizer_sample_bytes": sample_bytes,
        "vocab_size": int(train.tokens.vocab_size),
        "model_type": model_type if source is None else f"from {source}",
        "eos_id": train.tokens.eos_id,
        "split": {"by": "files"} if fraction is None else {"by": "document hash", "val_fraction": fraction},
        "train": _split_info(train, [str(t) for t in texts], names[0]),
        "val": _split_info(val, [str(t) for t in val_inputs], names[1]),
        "val_text": VAL_TEXT_FILE,
        "seconds": round(time.perf_counter() - start, 2),
    }
    meta["bytes_per_token"] = meta["train"]["bytes_per_token"]
    try:
        write_json_atomic(out / META_FILE, meta)
    except ValueError as exc:  # trainloop's refusal of a link in place of the file it writes
        raise LmtrainError(str(exc)) from None
    return meta


def _train_tokenizer(texts: list[str | os.PathLike], out: Path, sample: Path, sample_mb: float, vocab_size: int,
                     model_type: str, read: dict[str, Any], train_split: Any, progress: bool) -> int:  # fmt: skip
    """The lossless SentencePiece model trained on a sample of the training text, into OUT/tokenizer.model; returns
    the sample's bytes."""
    import tokbin
    from lmtrain.chat import CHAT_TOKENS
    from lmtrain.progress import step
    from lmtrain.text_codec import LOSSLESS_SPM_OPTIONS
    from tokbin.sample import write_sample

    with step(f"tokenizer: a sample of up to {sample_mb:g} MB spread over the training text", enabled=progress,
              bar=False):  # fmt: skip
        sample_bytes = write_sample(texts, sample, int(sample_mb * 1e6), hash_split=train_split, **read)
    if sample_bytes == 0:
        raise LmtrainError(f"{', '.join(map(str, texts))}: no training text found: expected documents to train on")
    try:
        # The chat template's role and end-of-turn markers are reserved as pieces of their own (lmtrain.chat).
        options = {**LOSSLESS_SPM_OPTIONS, "user_defined_symbols": [*LOSSLESS_SPM_OPTIONS["user_defined_symbols"],
                                                                    *CHAT_TOKENS]}  # fmt: skip
        with step(f"tokenizer: training {model_type} (vocab {vocab_size:,}) on {sample_bytes / 1e6:.3g} MB",
                  enabled=progress) as bar:  # fmt: skip
            model = tokbin.train_tokenizer([sample], out / Path(TOKENIZER_FILE).stem, vocab_size,
                                           model_type=model_type, progress=bar, **options)  # fmt: skip
    except (tokbin.TokenFileError, ValueError) as exc:
        raise LmtrainError(f"tokenizer training failed: {exc}") from None
    if model != out / TOKENIZER_FILE:
        shutil.move(model, out / TOKENIZER_FILE)
    return sample_bytes


def tokenizer_source(spec: str | os.PathLike) -> Path:
    """The SentencePiece model `--tokenizer` names: a run directory's tokenizer.model, or a .model file; anything
    else is one LmtrainError naming what it found."""
    import tokbin

    path = Path(spec)
    model = path / TOKENIZER_FILE if path.is_dir() else path
    if not model.is_file():
        found = "a directory without it" if path.is_dir() else "no such file"
        raise LmtrainError(f"--tokenizer {spec}: expected a run directory holding {TOKENIZER_FILE} or a "
                           f"SentencePiece .model file, found {found}")  # fmt: skip
    try:
        tokbin.load_tokenizer(model)
    except tokbin.TokenFileError as exc:
        raise LmtrainError(f"--tokenizer {spec}: {exc}") from None
    return model


def run_prepare(args: argparse.Namespace) -> int:
    """The `lmtrain prepare` command."""
    from tokbin.encode import default_workers

    if args.workers is not None and args.workers > default_workers():  # tokbin encodes on at most that many
        print(f"lmtrain prepare: --workers {args.workers} capped at {default_workers()} (the CPUs this process may "
              "run on)", file=sys.stderr)  # fmt: skip
    meta = prepare(
        args.text,
        args.out,
        val_texts=args.val_text,
        val_fraction=args.val_fraction,
        vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        model_type=args.model_type,
        jsonl_field=args.jsonl_field,
        parquet_column=args.parquet_column,
        split_docs=args.split_docs,
        workers=args.workers,
        sample_mb=args.tokenizer_sample_mb,
        shard_mb=args.shard_mb,
        skip_bad_lines=args.skip_bad_lines,
        clean=args.clean,
        progress=not args.quiet,
        tokenizer=args.tokenizer,
    )
    for split in ("train", "val"):
        info = meta[split]
        skipped = f", {info['skipped_lines']:,} bad lines skipped" if info["skipped_lines"] else ""
        print(
            f"{split}: {info['tokens']:,} tokens in {info['documents']:,} documents from {info['bytes']:,} bytes "
            f"({info['bytes_per_token']:.2f} bytes/token{skipped}) -> {Path(args.out) / info['file']}"
        )
    print(f"tokenizer: {Path(args.out) / meta['tokenizer']} (vocab {meta['vocab_size']}, {meta['model_type']})")
    print(f"meta: {Path(args.out) / META_FILE}")
    return 0
