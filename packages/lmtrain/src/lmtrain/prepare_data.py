"""`lmtrain prepare`: a corpus of any size -> tokenizer + train/val token files + meta.json.

Memory stays flat: the tokenizer trains on a bounded sample spread over the training corpus, the held-out split is
decided per document by a hash of its text (no copy or join of the corpus), and tokbin encodes in pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.recipes import DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE
from lmtrain.run_files import META_FILE, TOKENIZER_FILE, write_json_atomic

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
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    tmp.write_text("\n\n".join(parts), encoding="utf-8")
    os.replace(tmp, out)


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
) -> dict[str, Any]:
    """Train the tokenizer on a sample of the training corpus, encode both splits, write and return meta.json.

    Inputs are files, directories or globs of plain text, JSONL (``jsonl_field``) or Parquet (``parquet_column``).
    Without ``val_texts``, ``val_fraction`` of the documents (default 0.1) is held out by a hash of each document's
    text; plain text is then cut into documents at blank lines. ``shard_mb`` writes each split as a resumable shard
    directory instead of one file.

    Example (a little of the standard library's Python source as the corpus):
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from lmtrain.demo import build_corpus
        >>> work = tempfile.TemporaryDirectory()
        >>> _ = build_corpus(Path(work.name) / "input.txt", 100_000)
        >>> meta = prepare([Path(work.name) / "input.txt"], Path(work.name) / "data", vocab_size=400, progress=False)
        >>> meta["vocab_size"], meta["split"], meta["train"]["file"], meta["val"]["file"]
        (400, {'by': 'document hash', 'val_fraction': 0.1}, 'train.bin', 'val.bin')
        >>> meta["train"]["tokens"] > 10 * meta["val"]["tokens"] > 0, 1 < meta["train"]["bytes_per_token"] < 4
        (True, True)
        >>> sorted(os.listdir(Path(work.name) / "data"))  # doctest: +ELLIPSIS
        ['meta.json', 'tokenizer.model', ..., 'train.bin', ..., 'val.bin', ..., 'val.txt']
        >>> work.cleanup()
    """
    import tokbin
    from lmtrain.chat import CHAT_TOKENS
    from lmtrain.text_codec import LOSSLESS_SPM_OPTIONS
    from tokbin.sample import write_sample
    from tokbin.sources import PARQUET_EXTRA

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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_split = val_split = None
    if fraction is not None:
        train_split, val_split = tokbin.HashSplit(fraction, "train"), tokbin.HashSplit(fraction, "val")
    prefix = out / Path(TOKENIZER_FILE).stem
    sample = out / ".tokenizer_sample.txt"
    try:
        sample_bytes = write_sample(texts, sample, int(sample_mb * 1e6), hash_split=train_split, **read)
        if sample_bytes == 0:
            raise LmtrainError(f"{', '.join(map(str, texts))}: no training text found: expected documents to train on")
        try:
            # The chat template's role and end-of-turn markers are reserved as pieces of their own (lmtrain.chat).
            options = {**LOSSLESS_SPM_OPTIONS, "user_defined_symbols": [*LOSSLESS_SPM_OPTIONS["user_defined_symbols"],
                                                                        *CHAT_TOKENS]}  # fmt: skip
            model = tokbin.train_tokenizer([sample], prefix, vocab_size, model_type=model_type, **options)
        except (tokbin.TokenFileError, ValueError) as exc:
            raise LmtrainError(f"tokenizer training failed: {exc}") from None
        if model != out / TOKENIZER_FILE:
            shutil.move(model, out / TOKENIZER_FILE)
        tokenizer = out / TOKENIZER_FILE
        names = ("train", "val") if shard_mb is not None else ("train.bin", "val.bin")
        options = dict(read, workers=workers, progress=progress)
        if shard_mb is not None:
            options["shard_bytes"] = max(1, int(shard_mb * 1e6))
        train = tokbin.encode_inputs(tokenizer, texts, out / names[0], hash_split=train_split, **options)
        val_inputs = val_texts or texts
        if val_texts:
            options["split_docs"] = fmt_text and split_docs
        val = tokbin.encode_inputs(tokenizer, val_inputs, out / names[1], hash_split=val_split, **options)
        val_text = out / VAL_TEXT_FILE
        if not any(Path(v).resolve() == val_text.resolve() for v in val_inputs):  # never overwrite an input
            _write_val_text(tokenizer, val.tokens, val_text)
    except tokbin.TokenFileError as exc:
        if "no tokens to write" in str(exc) and fraction is not None:
            raise LmtrainError(
                f"{exc}: --val-fraction {fraction} left a split without documents; use more text, another "
                "fraction, or --val-text"
            ) from None
        hint = f" ({PARQUET_EXTRA})" if "pyarrow" in str(exc) else ""
        raise LmtrainError(f"{exc}{'' if hint in str(exc) else hint}") from None
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
        "model_type": model_type,
        "eos_id": train.tokens.eos_id,
        "split": {"by": "files"} if fraction is None else {"by": "document hash", "val_fraction": fraction},
        "train": _split_info(train, [str(t) for t in texts], names[0]),
        "val": _split_info(val, [str(t) for t in val_inputs], names[1]),
        "val_text": VAL_TEXT_FILE,
        "seconds": round(time.perf_counter() - start, 2),
    }
    meta["bytes_per_token"] = meta["train"]["bytes_per_token"]
    write_json_atomic(out / META_FILE, meta)
    return meta


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
