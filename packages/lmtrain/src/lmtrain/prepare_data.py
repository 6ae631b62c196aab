"""`lmtrain prepare`: text files -> tokenizer + train/val token files + meta.json."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.recipes import DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE
from lmtrain.run_files import META_FILE, TOKENIZER_FILE, write_json_atomic


def split_by_fraction(texts: list[Path], out_dir: Path, val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Concatenate `texts` and write the first 1 - val_fraction of the characters to train.txt, the rest to
    val.txt (nanoGPT's split). Returns ([train.txt], [val.txt])."""
    if not 0 < val_fraction < 1:
        raise LmtrainError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    text = "".join(_read(p) for p in texts)
    cut = int(len(text) * (1 - val_fraction))
    train, val = out_dir / "train.txt", out_dir / "val.txt"
    train.write_text(text[:cut], encoding="utf-8")
    val.write_text(text[cut:], encoding="utf-8")
    if not text[:cut].strip() or not text[cut:].strip():
        raise LmtrainError(f"--val-fraction {val_fraction} leaves an empty split of {len(text)} characters")
    return [train], [val]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LmtrainError(f"--text {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LmtrainError(f"--text {path}: cannot read UTF-8 text: {exc}") from None


def _split_info(token_file: Any, sources: list[Path], name: str) -> dict[str, Any]:
    n_bytes = sum(p.stat().st_size for p in sources)
    return {
        "file": name,
        "sources": [str(p.resolve()) for p in sources],
        "tokens": int(token_file.n_tokens),
        "documents": int(token_file.n_docs),
        "bytes": n_bytes,
        "bytes_per_token": n_bytes / max(1, int(token_file.n_tokens)),
    }


def prepare(
    texts: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    val_texts: list[str | os.PathLike] | None = None,
    val_fraction: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    progress: bool = True,
) -> dict[str, Any]:
    """Train the tokenizer on the training text, encode both splits, write and return meta.json's content.

    Example:
        >>> meta = prepare(["input.txt"], "data/shakespeare", val_fraction=0.1)  # doctest: +SKIP
        >>> meta["train"]["bytes_per_token"]  # doctest: +SKIP
    """
    import tokbin
    from lmtrain.text_codec import LOSSLESS_SPM_OPTIONS

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_paths = [Path(p) for p in texts]
    for p in train_paths + [Path(v) for v in val_texts or []]:
        if not p.is_file():
            raise LmtrainError(f"{p}: no such text file")
    if val_texts:
        val_paths = [Path(p) for p in val_texts]
    else:
        train_paths, val_paths = split_by_fraction(train_paths, out, val_fraction or DEFAULT_VAL_FRACTION)
    start = time.perf_counter()
    prefix = out / Path(TOKENIZER_FILE).stem
    try:
        model = tokbin.train_tokenizer(train_paths, prefix, vocab_size, model_type=model_type, **LOSSLESS_SPM_OPTIONS)
    except (tokbin.TokenFileError, ValueError) as exc:
        raise LmtrainError(f"tokenizer training failed: {exc}") from exc
    if model != out / TOKENIZER_FILE:
        shutil.move(model, out / TOKENIZER_FILE)
    tokenizer = out / TOKENIZER_FILE
    train_file = tokbin.encode_files(tokenizer, train_paths, out / "train.bin", progress=progress)
    val_file = tokbin.encode_files(tokenizer, val_paths, out / "val.bin", progress=progress)
    meta = {
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokbin.file_sha256(tokenizer),
        "vocab_size": int(train_file.vocab_size),
        "model_type": model_type,
        "eos_id": train_file.eos_id,
        "train": _split_info(train_file, train_paths, "train.bin"),
        "val": _split_info(val_file, val_paths, "val.bin"),
        "seconds": round(time.perf_counter() - start, 2),
    }
    meta["bytes_per_token"] = meta["train"]["bytes_per_token"]
    write_json_atomic(out / META_FILE, meta)
    return meta


def run_prepare(args: argparse.Namespace) -> int:
    """The `lmtrain prepare` command."""
    meta = prepare(
        args.text,
        args.out,
        val_texts=args.val_text,
        val_fraction=args.val_fraction,
        vocab_size=args.vocab_size or DEFAULT_VOCAB_SIZE,
        model_type=args.model_type,
    )
    for split in ("train", "val"):
        info = meta[split]
        print(
            f"{split}: {info['tokens']:,} tokens from {info['bytes']:,} bytes "
            f"({info['bytes_per_token']:.2f} bytes/token) -> {Path(args.out) / info['file']}"
        )
    print(f"tokenizer: {Path(args.out) / meta['tokenizer']} (vocab {meta['vocab_size']}, {meta['model_type']})")
    print(f"meta: {Path(args.out) / META_FILE}")
    return 0
