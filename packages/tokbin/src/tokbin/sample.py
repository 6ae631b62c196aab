"""A bounded, evenly spread text sample of a corpus of any size, to train a tokenizer on."""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

from tokbin.documents import DocOptions, HashSplit, segments
from tokbin.sources import ReadOptions, expand_inputs, read_pieces
from tokbin.writer import atomic_output

SAMPLE_PIECE_BYTES = 1 << 16
# Longest line of a sample, in UTF-8 bytes: under SentencePiece's default max_sentence_length (4192), which leaves
# longer lines out of training, so a corpus of long lines (or one without a newline) left it nothing to train on.
SAMPLE_LINE_BYTES = 4096
_LONG_LINE = re.compile(rb"[^\n]{%d,}" % (SAMPLE_LINE_BYTES + 1))


def split_long_lines(raw: bytes, limit: int = SAMPLE_LINE_BYTES) -> bytes:
    """``raw`` with a newline inserted wherever a line would be longer than ``limit`` bytes: before the last space
    that keeps it within the limit, else between two UTF-8 characters.

    Example:
        >>> split_long_lines(b"aaa bbb ccc", limit=8)
        b'aaa bbb\\n ccc'
    """
    if limit < 4:
        raise ValueError(f"limit must be >= 4 (the longest UTF-8 character), got {limit}")
    pattern = _LONG_LINE if limit == SAMPLE_LINE_BYTES else re.compile(rb"[^\n]{%d,}" % (limit + 1))
    return pattern.sub(lambda m: _cut(m.group(), limit), raw)


def _cut(line: bytes, limit: int) -> bytes:
    parts, start = [], 0
    while len(line) - start > limit:
        end = line.rfind(b" ", start + 1, start + limit + 1)  # a word keeps its leading space, as mid-line
        if end < 0:
            end = start + limit
            while line[end] & 0xC0 == 0x80:  # a continuation byte: step back to the character's start
                end -= 1
        parts.append(line[start:end])
        start = end
    parts.append(line[start:])
    return b"\n".join(parts)


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
    clean: bool = False,
) -> int:
    """Write about ``n_bytes`` of the inputs' document text to ``output`` as plain text; return the bytes written.

    The inputs are read in 64 KiB pieces and a piece is kept whenever the sample falls behind ``n_bytes`` times the
    fraction of the corpus read so far, so the sample is spread evenly over the whole corpus, the same on every run,
    and memory holds one piece (a line longer than a piece makes the piece that long). Under ``hash_split`` the
    whole documents of the other part are left out. Smaller corpora are copied whole (as text). Lines longer than
    ``SAMPLE_LINE_BYTES`` are split (``split_long_lines``) so that SentencePiece trains on them.

    ``clean`` cleans each document as ``encode_files(clean=True)`` does, so a tokenizer trains on the text it will
    encode.

    Example: ``write_sample(["web/"], "sample.txt", 200_000_000, jsonl_field="text")``
    """
    fmt = "jsonl" if jsonl_field is not None else "parquet" if parquet_column is not None else "text"
    paths = expand_inputs(inputs, fmt)
    total = sum(p.stat().st_size for p in paths)  # compressed inputs count their stored size: spread, not exact
    ratio = min(1.0, n_bytes / max(1, total))
    opts = ReadOptions(fmt, split_docs and fmt == "text", clean, SAMPLE_PIECE_BYTES)
    doc_opts = DocOptions(fmt, opts.split_docs, clean, errors, jsonl_field or parquet_column, skip_bad_lines)
    seen = written = 0
    with atomic_output(Path(output), lock=False) as out:  # never through a link in its place
        for piece in read_pieces(paths, opts, parquet_column=parquet_column):
            seen += piece.n_bytes
            if ratio < 1 and written >= seen * ratio:
                continue
            texts, closed, _ = segments(piece, doc_opts)
            for i, text in enumerate(texts):
                whole = 0 < i < len(texts) - 1 or (i == len(texts) - 1 and closed[i] and i > 0)
                raw = text.encode("utf-8")
                if whole and hash_split is not None and not hash_split.keeps(zlib.crc32(raw), len(raw)):
                    continue
                raw = split_long_lines(raw)
                raw = raw if raw.endswith(b"\n") else raw + b"\n"
                out.write(raw)
                written += len(raw)
    return written
