"""One piece of input to encoded documents: decode, clean, cut documents, read JSONL fields or Parquet values, pick
held-out documents by hash, run the tokenizer. This is what each worker process does.

The unit SentencePiece sees is the line, newline kept: pieces hold whole lines, so the ids never depend on where
pieces were cut, and with the lossless options ("\\n" a user-defined symbol) they equal those of the whole text.
A Hugging Face tokenizer sees whole documents, or runs of them cut after a line end that a printable byte follows
where its ids cannot tell the cut (``HFTokenizer.cuts_at_line_ends``, ``tokbin.sources.cut_patterns``), so its ids
equal its own encode of each document.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from tokbin.cleaning import clean_text
from tokbin.errors import TokenFileError
from tokbin.sources import Piece

ERRORS = ("strict", "replace", "ignore")
# A document of blank-line-separated text ends after a run of blank lines: the blank lines stay with it and the
# next line's own indentation with the next document, so the documents joined are the text, byte for byte.
DOCUMENT_END = re.compile(r"\n[ \t\r]*\n(?:[ \t\r]*\n)*")
_KEY = struct.Struct("<IQ")


@dataclass(frozen=True)
class HashSplit:
    """Keep the documents whose hash key falls below ``fraction`` (``part="val"``) or the others (``"train"``).

    The key is BLAKE2b of the document's UTF-8 CRC-32 and length, read as a number in [0, 1): the same corpus gives
    the same split on any machine, and identical documents always land in the same part.

    Example: ``HashSplit(0.01, "val")`` keeps about 1% of the documents.
    """

    fraction: float
    part: str

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1:
            raise ValueError(f"hash split fraction must be in (0, 1), got {self.fraction}")
        if self.part not in ("train", "val"):
            raise ValueError(f"hash split part must be 'train' or 'val', got {self.part!r}")

    def keeps(self, crc: int, n_bytes: int) -> bool:
        digest = hashlib.blake2b(_KEY.pack(crc, n_bytes), digest_size=8).digest()
        below = int.from_bytes(digest, "little") < self.fraction * 2.0**64
        return below == (self.part == "val")


@dataclass(frozen=True)
class DocOptions:
    """How a piece becomes documents (the worker's share of the encode options)."""

    fmt: str = "text"
    split_docs: bool = False
    clean: bool = False
    errors: str = "strict"
    field: str | None = None  # JSONL field or Parquet column
    skip_bad_lines: bool = False
    eos_id: int | None = None
    hash_split: HashSplit | None = None


@dataclass
class Part:
    """A document, or the part of one that a piece holds, encoded: EOS appended when ``closed``."""

    ids: np.ndarray
    closed: bool
    crc: int
    n_bytes: int


@dataclass
class PieceResult:
    """A piece encoded: ``head`` (its first document, which may continue one from the piece before), ``body``
    (whole documents, already filtered by the hash split: ids and per-document lengths), ``tail`` (a last document
    that goes on in the next piece), and the count of skipped bad lines."""

    head: Part | None
    body: np.ndarray
    body_lengths: np.ndarray
    body_bytes: int
    tail: Part | None
    bad_lines: int


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python does not expose)."""
    if len2 == 0:
        return crc1

    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat: list[int]) -> list[int]:
        return [times(mat, mat[n]) for n in range(32)]

    op = [0xEDB88320] + [1 << n for n in range(31)]  # the operator that appends one zero bit
    for _ in range(3):
        op = square(op)  # 2, 4, then 8 zero bits: one zero byte
    while len2:  # append len2 zero bytes to crc1, a power of two at a time
        if len2 & 1:
            crc1 = times(op, crc1)
        len2 >>= 1
        if len2:
            op = square(op)
    return crc1 ^ crc2


def _bad(piece: Piece, opts: DocOptions, number: int, message: str) -> None:
    if not opts.skip_bad_lines:
        unit = "row" if opts.fmt == "parquet" else "line"
        raise TokenFileError(piece.path, f"{unit} {number}: {message} (--skip-bad-lines skips such {unit}s)")


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _decode(piece: Piece, data: bytes, errors: str) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        line = piece.line + data.count(b"\n", 0, e.start)
        raise TokenFileError(
            piece.path,
            f"not valid UTF-8 at byte {piece.offset + e.start} (line {line}): expected UTF-8 text, "
            f"found {data[e.start : e.start + 4]!r} (see --errors replace)",
        ) from None


def split_documents(text: str, last: bool = True) -> list[str]:
    """The documents of blank-line-separated `text`; joined, they are `text` (every byte kept).

    A document ends after a run of blank lines (which it keeps). Whitespace before the first document goes with
    it, a whitespace-only tail with the last one; a text of whitespace only holds no document. With `last` False
    the text goes on in the next piece: its final document is returned even when empty, to be continued.

    Example:
        >>> split_documents("first\\nstill first\\n\\n  second, indented\\n \\n\\nthird\\n")
        ['first\\nstill first\\n\\n', '  second, indented\\n \\n\\n', 'third\\n']
    """
    docs, start, pending = [], 0, ""
    for match in DOCUMENT_END.finditer(text):
        doc = pending + text[start : match.end()]
        start = match.end()
        if doc.strip():
            docs.append(doc)
            pending = ""
        else:  # blank lines at the start of the text: they open the first document
            pending = doc
    tail = pending + text[start:]
    if tail.strip() or not last:
        docs.append(tail)
    elif tail and docs:
        docs[-1] += tail
    return docs


def segments(piece: Piece, opts: DocOptions) -> tuple[list[str], list[bool], int]:
    """(texts, closed, bad lines): the piece's documents in order; ``closed[i]`` says a document ends after text i.

    Only the first text can continue a document of the piece before, only the last can go on in the next one.
    """
    data = piece.data
    if isinstance(data, list):  # Parquet: the column's values, one per row
        values = data
    elif opts.fmt == "text":
        text = _decode(piece, data, opts.errors)
        if opts.clean:
            text = clean_text(text)
        if not opts.split_docs:
            return [text], [piece.last], 0
        texts = split_documents(text, piece.last)
        return texts, [True] * (len(texts) - 1) + [piece.last], 0
    else:  # JSONL
        values = data.split(b"\n")
    texts, bad = [], 0
    for k, raw in enumerate(values):
        number = piece.line + k
        if opts.fmt == "parquet":
            value = raw
            if not isinstance(value, str):
                bad += 1
                _bad(piece, opts, number, f"column {opts.field!r}: expected a string, found {_json_type(value)}")
                continue
        else:
            if not raw.strip():
                continue  # blank lines (a trailing newline, say) hold no document
            try:
                obj = json.loads(raw.decode("utf-8", errors=opts.errors))
            except UnicodeDecodeError as e:
                bad += 1
                _bad(piece, opts, number, f"not valid UTF-8 at byte {e.start} of the line: expected UTF-8 JSON")
                continue
            except json.JSONDecodeError as e:
                bad += 1
                _bad(piece, opts, number, f"expected a JSON object, found invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                bad += 1
                _bad(piece, opts, number, f"expected a JSON object, found a JSON {_json_type(obj)}")
                continue
            if opts.field not in obj:
                bad += 1
                keys = ", ".join(map(repr, list(obj)[:5])) or "none"
                _bad(piece, opts, number, f"no field {opts.field!r}: expected a string there, found keys {keys}")
                continue
            value = obj[opts.field]
            if not isinstance(value, str):
                bad += 1
                _bad(piece, opts, number, f"field {opts.field!r}: expected a string, found a {_json_type(value)}")
                continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            bad += 1
            _bad(piece, opts, number, f"{opts.field!r}: expected Unicode text, found a lone surrogate")
            continue
        if value.strip():
            texts.append(value)
    return texts, [True] * len(texts), bad


def _encode_units(tok, texts: list[str]) -> tuple[list[list[str]], list[list[int]]]:
    """(the units of each text, the ids of each unit): lines for SentencePiece, whole documents otherwise.

    SentencePiece runs on one thread: parallelism is across pieces. Its default (-1) starts a thread per core for a
    list, which oversubscribes the cores under worker processes; one thread per worker measured fastest (200 MB on
    2 cores: 2 workers x 1 thread 23-25 s, 1 worker x 2 threads 31 s, 2 x 2 27 s, 1 x 1 51 s). A Hugging Face
    tokenizer's pre-tokenizer can join text across a newline (Qwen2's ``\\s*[\\r\\n]+`` makes one token of a blank line
    run), so its unit is the whole document, whose ids then equal ``tokenizers``' own encode of it.
    """
    if getattr(tok, "kind", None) == "sentencepiece":
        units = [t.splitlines(keepends=True) for t in texts]
        flat = list(itertools.chain.from_iterable(units))
        return units, tok.processor.encode(flat, out_type=int, num_threads=1)
    return [[t] for t in texts], tok.encode_batch(texts)


def encode_piece(tok, piece: Piece, opts: DocOptions, dtype: np.dtype) -> PieceResult:
    """Encode one piece with the tokenizer ``tok`` (a :class:`tokbin.text_tokenizer.Tokenizer`)."""
    texts, closed, bad = segments(piece, opts)
    raw = [t.encode("utf-8") for t in texts]
    n = len(texts)
    tail_index = n - 1 if n > 1 and not closed[-1] else None
    keep = [True] * n
    if opts.hash_split is not None:
        for i in range(1, n if tail_index is None else tail_index):  # whole documents: decided here
            keep[i] = opts.hash_split.keeps(zlib.crc32(raw[i]), len(raw[i]))
    chosen = [i for i in range(n) if keep[i]]
    lines, ids = _encode_units(tok, [texts[i] for i in chosen])
    line_lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(line_lens.sum()))
    token_ends = np.concatenate([[0], np.cumsum(line_lens)])[np.cumsum([len(ls) for ls in lines], dtype=np.int64)]
    token_starts = np.concatenate([[0], token_ends])[:-1]
    bounds = {i: (int(s), int(e)) for i, s, e in zip(chosen, token_starts, token_ends, strict=True)}
    eos = [] if opts.eos_id is None else [opts.eos_id]

    def part(i: int) -> Part:
        lo, hi = bounds[i]
        ids_i = np.concatenate([flat[lo:hi], eos]) if closed[i] and eos else flat[lo:hi]
        return Part(ids_i.astype(dtype), closed[i], zlib.crc32(raw[i]), len(raw[i]))

    inner = [i for i in chosen if i != 0 and i != tail_index]  # whole documents, contiguous in flat
    if inner:
        lo, hi = bounds[inner[0]][0], bounds[inner[-1]][1]
        ends = np.array([bounds[i][1] - lo for i in inner], dtype=np.int64)
        body = np.insert(flat[lo:hi], ends, opts.eos_id) if opts.eos_id is not None else flat[lo:hi]
        lengths = np.diff(np.concatenate([[0], ends])) + len(eos)
    else:
        body, lengths = np.zeros(0, np.int64), np.zeros(0, np.int64)
    return PieceResult(
        head=part(0) if n else None,
        body=body.astype(dtype),
        body_lengths=lengths,
        body_bytes=sum(len(raw[i]) for i in inner),
        tail=part(tail_index) if tail_index is not None else None,
        bad_lines=bad,
    )
