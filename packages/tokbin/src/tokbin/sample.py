"""A bounded, evenly spread text sample of a corpus of any size, to train a tokenizer on."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from tokbin.documents import DocOptions, HashSplit, segments
from tokbin.sources import ReadOptions, expand_inputs, read_pieces

SAMPLE_PIECE_BYTES = 1 << 16


def write_sample(
    inputs: list[str | os.PathLike],
    output: str | os.PathLike,
    n_bytes: int,
    *,
    jsonl_field: str | None = None,
    parquet_column: str | None = None,
    split_docs: bool = False,
    errors: str = "strict",
    skip_bad_lines: bool = False,
    hash_split: HashSplit | None = None,
) -> int:
    """Write about ``n_bytes`` of the inputs' document text to ``output`` as plain text; return the bytes written.

    The inputs are read in 64 KiB pieces and a piece is kept whenever the sample falls behind ``n_bytes`` times the
    fraction of the corpus read so far, so the sample is spread evenly over the whole corpus, the same on every run,
    and memory holds one piece. Under ``hash_split`` the whole documents of the other part are left out. Smaller
    corpora are copied whole (as text).

    Example: ``write_sample(["web/"], "sample.txt", 200_000_000, jsonl_field="text")``
    """
    fmt = "jsonl" if jsonl_field is not None else "parquet" if parquet_column is not None else "text"
    paths = expand_inputs(inputs, fmt)
    total = sum(p.stat().st_size for p in paths)  # compressed inputs count their stored size: spread, not exact
    ratio = min(1.0, n_bytes / max(1, total))
    opts = ReadOptions(fmt, split_docs and fmt == "text", False, SAMPLE_PIECE_BYTES)
    doc_opts = DocOptions(fmt, opts.split_docs, False, errors, jsonl_field or parquet_column, skip_bad_lines)
    seen = written = 0
    with open(Path(output), "w", encoding="utf-8", newline="") as out:
        for piece in read_pieces(paths, opts, parquet_column=parquet_column):
            seen += piece.n_bytes
            if ratio < 1 and written >= seen * ratio:
                continue
            texts, closed, _ = segments(piece, doc_opts)
            for i, text in enumerate(texts):
                whole = 0 < i < len(texts) - 1 or (i == len(texts) - 1 and closed[i] and i > 0)
                if whole and hash_split is not None:
                    raw = text.encode("utf-8")
                    if not hash_split.keeps(zlib.crc32(raw), len(raw)):
                        continue
                out.write(text if text.endswith("\n") else text + "\n")
                written += len(text.encode("utf-8")) + (not text.endswith("\n"))
    return written
