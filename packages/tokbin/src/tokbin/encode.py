"""Parallel, deterministic encoding of text files into a token file."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokbin.cleaning import clean_text
from tokbin.errors import TokenFileError
from tokbin.tokenfile import TokenFile
from tokbin.tokenizer import file_sha256, load_processor
from tokbin.writer import write_tokens

ERRORS = ("strict", "replace", "ignore")
# Text per batched SentencePiece call: big enough to keep its threads busy, small enough to bound memory.
_CHUNK_CHARS = 1 << 22
_BLANK_LINE = re.compile(r"\n[ \t\r]*\n\s*")


def default_workers() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def read_text(path: Path, errors: str = "strict") -> str:
    """Decode a file as UTF-8; a bad byte raises TokenFileError with the file and byte position."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenFileError(path, "no such file: expected a UTF-8 text file") from None
    except IsADirectoryError:
        raise TokenFileError(path, "is a directory: expected a UTF-8 text file") from None
    if not data:
        raise TokenFileError(path, "empty input: expected text, found 0 bytes")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        bad = data[e.start : e.start + 4]
        raise TokenFileError(
            path, f"not valid UTF-8 at byte {e.start}: expected UTF-8 text, found {bad!r} (see --errors replace)"
        ) from None


def _documents(inputs: list[Path], split_docs: bool, clean: bool, errors: str, bar: tqdm) -> Iterator[tuple[str, int]]:
    """(document text, input bytes it stands for) in input order; the byte count only feeds the progress bar."""
    for path in inputs:
        text = read_text(path, errors)
        size = path.stat().st_size
        if clean:
            text = clean_text(text)
        docs = [d for d in _BLANK_LINE.split(text) if d.strip()] if split_docs else [text]
        per_char = size / max(1, sum(len(d) for d in docs))
        for d in docs:
            yield d, int(len(d) * per_char)
        bar.set_postfix_str(path.name, refresh=False)


def _encode_chunk(sp, docs: list[str], workers: int, eos_id: int | None) -> list[np.ndarray]:
    # The unit of encoding is the line (newline kept), whatever the worker count: that is what makes N workers
    # produce exactly the bytes of 1 worker, and lines are short enough for SentencePiece's per-piece search.
    lines_per_doc = [d.splitlines(keepends=True) for d in docs]
    all_lines = list(itertools.chain.from_iterable(lines_per_doc))
    ids = sp.encode(all_lines, num_threads=workers)
    line_lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(line_lens.sum()))
    line_ends = np.cumsum(line_lens)
    doc_line_ends = np.cumsum([len(ls) for ls in lines_per_doc])
    out = []
    start = 0
    for end_line in doc_line_ends:
        end = int(line_ends[end_line - 1]) if end_line else 0
        doc = flat[start:end]
        out.append(doc if eos_id is None else np.append(doc, np.int32(eos_id)))
        start = end
    return out


def encode_files(
    tokenizer: str | os.PathLike,
    inputs: list[str | os.PathLike],
    output: str | os.PathLike,
    *,
    workers: int | None = None,
    eos: bool = True,
    split_docs: bool = False,
    clean: bool = False,
    progress: bool = True,
    errors: str = "strict",
) -> TokenFile:
    """Encode UTF-8 text files with a SentencePiece model into the token file ``output`` and open it.

    A document is a whole file, or with ``split_docs`` each blank-line-separated block; an EOS id follows every
    document unless ``eos=False``. ``workers`` SentencePiece threads (default: all CPUs) encode batches of lines;
    the output is byte-identical for any worker count. ``clean`` strips HTML tags, citation marks and whitespace
    runs first. ``errors`` is how undecodable bytes are handled: "strict" (raise, naming the file), "replace",
    "ignore".

    Example::

        tf = encode_files("spm.model", ["a.txt", "b.txt"], "train.bin", workers=2)
        tf.n_docs  # 2
    """
    if errors not in ERRORS:
        raise ValueError(f"errors must be one of {ERRORS}, got {errors!r}")
    if not inputs:
        raise ValueError("inputs: expected at least one text file, got none")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    sp = load_processor(tokenizer)
    eos_id = sp.eos_id() if eos else None
    if eos and eos_id < 0:
        raise TokenFileError(tokenizer, "tokenizer has no EOS piece: expected one for eos=True (or pass eos=False)")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise TokenFileError(p, "no such file: expected a UTF-8 text file")
    total = sum(p.stat().st_size for p in paths)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="encode", disable=not progress)

    def docs() -> Iterator[np.ndarray]:
        pending: list[str] = []
        pending_chars = pending_bytes = 0
        for text, nbytes in _documents(paths, split_docs, clean, errors, bar):
            pending.append(text)
            pending_chars += len(text)
            pending_bytes += nbytes
            if pending_chars >= _CHUNK_CHARS:
                yield from _encode_chunk(sp, pending, workers, eos_id)
                bar.update(pending_bytes)
                pending, pending_chars, pending_bytes = [], 0, 0
        if pending:
            yield from _encode_chunk(sp, pending, workers, eos_id)
            bar.update(pending_bytes)

    try:
        tf = write_tokens(
            output, docs(), vocab_size=sp.get_piece_size(), eos_id=eos_id, tokenizer_sha256=file_sha256(tokenizer)
        )
        bar.update(total - bar.n)  # per-document byte shares are estimates; the whole input is done
        return tf
    finally:
        bar.close()
