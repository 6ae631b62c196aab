"""Encode inputs read in pieces: plain text, JSONL and Parquet files, gzip or zstd compressed, from files, directories
and globs, in a fixed order.

A piece ends only where cutting cannot change the result (see ``cut_patterns``), so encoding the pieces one by one
gives exactly the ids of encoding each whole input; memory holds a piece, never a file. Shards end at the first
document boundary after ``shard_bytes`` of input, which depends on the input alone, not on the piece size.
"""

from __future__ import annotations

import glob
import gzip
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tokbin.errors import TokenFileError

FORMATS = ("text", "jsonl", "parquet")
PIECE_BYTES = 1 << 20
MAX_PIECE_BYTES = 1 << 30  # a piece is read whole into memory, in every encoding process
_COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_NEVER = re.compile(rb"(?!)")  # a pattern that matches nowhere
_FORMAT_SUFFIXES = {"jsonl": (".jsonl", ".json", ".ndjson"), "parquet": (".parquet",)}


@dataclass(frozen=True)
class ReadOptions:
    """How inputs are cut into documents and pieces (the options of ``tokbin encode`` that read input)."""

    fmt: str = "text"
    split_docs: bool = False
    clean: bool = False
    piece_bytes: int = PIECE_BYTES
    shard_bytes: int | None = None
    whole_documents: bool = False  # pieces end only at document ends (a Hugging Face tokenizer's unit)
    printable_after_cut: bool = False  # a line end cuts only between printable non-space ASCII bytes

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if not 1 <= self.piece_bytes <= MAX_PIECE_BYTES:
            raise ValueError(
                f"piece_bytes must be in [1, {MAX_PIECE_BYTES}] (1 GiB: every encoding process holds a piece in "
                f"memory, twice), got {self.piece_bytes}; the default is {PIECE_BYTES} (--piece-kb {PIECE_BYTES >> 10})"
            )
        if self.shard_bytes is not None and self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")


@dataclass(frozen=True)
class Position:
    """Where reading resumes: input number, offset (bytes of decompressed text, or rows of Parquet) and line."""

    input: int = 0
    offset: int = 0
    line: int = 1


@dataclass
class Piece:
    """A run of whole lines (or Parquet rows) of one input."""

    input: int
    path: str
    offset: int  # decompressed byte offset (Parquet: row index) of the piece in its input
    line: int  # 1-based number of its first line (Parquet: first row)
    data: bytes | list  # raw bytes, or the Parquet column's values
    first: bool  # starts its input
    last: bool  # ends its input
    shard_end: bool = False  # the shard ends with this piece
    n_bytes: int = 0  # input bytes the piece stands for (shard sizing, progress)

    def end(self) -> Position:
        """The position right after this piece."""
        if self.last:
            return Position(self.input + 1, 0, 1)
        if isinstance(self.data, list):
            return Position(self.input, self.offset + len(self.data), self.line + len(self.data))
        return Position(self.input, self.offset + len(self.data), self.line + self.data.count(b"\n"))


def cut_patterns(opts: ReadOptions) -> tuple[re.Pattern[bytes], re.Pattern[bytes] | None]:
    """(where a piece may end, where a document surely ends) as byte patterns; a cut is right after a match.

    - plain text: any line end (a document is the file: no boundary inside it);
    - ``split_docs``: a line end followed by a printable non-space ASCII byte, so no blank-line separator (whose
      ``\\s*`` would eat it) spans the cut; documents end after ``\\n[ \\t\\r]*\\n`` followed by such a byte;
    - ``clean``: a line end followed by an ASCII letter, which no cleaning rule (tags start with '<', citation marks
      with '[' and hold only digits, commas and dashes across lines, blank-line runs are newlines) reaches across;
    - JSONL: any line end, and every line end ends a document.

    With ``whole_documents`` (a tokenizer whose ids depend on text across line ends) a piece ends only where a
    document does: a plain-text file without ``split_docs`` is one piece, whatever its size. With
    ``printable_after_cut`` (a Hugging Face tokenizer whose ids do not depend on text across such a line end,
    ``HFTokenizer.cuts_at_line_ends``) a piece ends at a line end between two printable non-space ASCII bytes: a
    whitespace run there (which GPT-2's ``\\s+(?!\\S)`` splits by what follows it) is one line end long.
    """
    if opts.fmt == "jsonl":
        line = re.compile(rb"\n")
        return line, line
    nxt = rb"[A-Za-z]" if opts.clean else rb"[!-~]"
    doc = re.compile(rb"\n[ \t\r]*\n(?=" + nxt + rb")") if opts.split_docs else None
    if opts.whole_documents:
        return doc or _NEVER, doc
    if opts.printable_after_cut:
        return re.compile(rb"(?<=[!-~])\n(?=" + nxt + rb")"), doc
    if not (opts.clean or opts.split_docs):
        return re.compile(rb"\n"), None
    return re.compile(rb"\n(?=" + nxt + rb")"), doc


def expand_inputs(inputs: list[str | os.PathLike], fmt: str = "text") -> list[Path]:
    """Files named by ``inputs`` in order: a file as is, a directory's files (recursive, sorted, hidden ones and, for
    JSONL and Parquet, other suffixes left out), a glob's matches sorted.

    Example: ``expand_inputs(["data/", "extra/*.txt.gz"])``
    """
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = [f for f in sorted(p.rglob("*")) if f.is_file() and _wanted(f.relative_to(p), fmt)]
            if not found:
                raise TokenFileError(p, f"directory holds no {fmt} input files: expected at least one")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        elif glob.has_magic(str(item)):
            found = [Path(f) for f in sorted(glob.glob(str(item), recursive=True)) if Path(f).is_file()]
            if not found:
                raise TokenFileError(item, "glob matches no file: expected at least one input file")
            out.extend(found)
        else:
            raise TokenFileError(p, "no such file: expected an input file, directory or glob")
    return out


def _wanted(rel: Path, fmt: str) -> bool:
    if any(part.startswith(".") for part in rel.parts):
        return False
    name = rel.name.lower()
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return fmt not in _FORMAT_SUFFIXES or name.endswith(_FORMAT_SUFFIXES[fmt])


def compression(path: Path) -> str | None:
    """'gzip', 'zstd' or None, from the file name."""
    return _COMPRESSED.get(path.suffix.lower())


def open_input(path: Path, offset: int = 0):
    """A binary stream of the decompressed input, positioned at ``offset``.

    gzip is read with the standard library. Python 3.11's standard library has no zstd; ``.zst`` inputs are read
    through pyarrow's codec, installed with the parquet extra.
    """
    kind = compression(path)
    if kind is None:
        plain = open(path, "rb")  # noqa: SIM115 - the caller closes it
        plain.seek(offset)
        return plain
    if kind == "zstd":
        pa = _pyarrow(path, "reading .zst input")
        stream = Decompressed(pa.input_stream(str(path), compression="zstd"), path, kind, (pa.ArrowException,))
    else:
        gz = gzip.open(path, "rb")  # noqa: SIM115 - the caller closes it
        stream = Decompressed(gz, path, kind, (EOFError, zlib.error, gzip.BadGzipFile))
    left = offset  # compressed streams cannot seek: decompress and drop what came before
    while left:
        skipped = len(read_full(stream, min(left, 1 << 24)))
        if not skipped:
            raise TokenFileError(path, f"input is shorter than the resume offset {offset}: it changed")
        left -= skipped
    return stream


class Decompressed:
    """A decompressing stream whose errors for damaged data (a truncated or corrupt file) are one TokenFileError
    naming the file and how far it decompressed, instead of zlib's, gzip's or pyarrow's own exception."""

    def __init__(self, stream, path: Path, kind: str, damaged: tuple[type[BaseException], ...]) -> None:
        self._stream, self.path, self.kind, self._damaged = stream, path, kind, damaged
        self.position = 0  # decompressed bytes read so far

    def read(self, n: int) -> bytes:
        try:
            data = self._stream.read(n)
        except OSError as e:
            if e.errno is not None:  # a real read error (EIO, ...), not damaged data: as it is
                raise
            self._refuse(e)  # pyarrow's codecs say "Truncated compressed stream" as an OSError without errno
        except self._damaged as e:
            self._refuse(e)
        self.position += len(data)
        return data

    def _refuse(self, e: BaseException) -> NoReturn:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenFileError(
            self.path,
            f"damaged {self.kind} data after {self.position} decompressed bytes ({reason}): expected a whole "
            f"{self.kind} file; compress it again from its source, or leave it out",
        ) from None

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Decompressed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_full(stream, n: int) -> bytes:
    """``n`` bytes, fewer only at the end of the stream (a decompressing stream may return short reads)."""
    data = stream.read(n)
    while 0 < len(data) < n:
        more = stream.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _pyarrow(path: object, what: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401 - makes pa.parquet available
    except ImportError:
        from tokbin.extras import install_hint

        raise TokenFileError(path, f"{what} needs pyarrow: {install_hint('parquet')}") from None
    return pa


def read_pieces(
    paths: list[Path], opts: ReadOptions, start: Position = Position(), *, parquet_column: str | None = None
) -> Iterator[Piece]:
    """Pieces of ``paths`` from ``start`` on, in input order; ``Piece.shard_end`` marks the ends of shards."""
    shard_used = 0  # input bytes of the current shard so far; shards end at document boundaries, so 0 at a start
    for i in range(start.input, len(paths)):
        offset, line = (start.offset, start.line) if i == start.input else (0, 1)
        if opts.fmt == "parquet":
            pieces = _parquet_pieces(i, paths[i], opts, offset, parquet_column, shard_used)
        else:
            pieces = _line_pieces(i, paths[i], opts, offset, line, shard_used)
        for piece in pieces:
            shard_used = 0 if piece.shard_end else shard_used + piece.n_bytes
            yield piece


def _line_pieces(i: int, path: Path, opts: ReadOptions, offset: int, line: int, shard_used: int) -> Iterator[Piece]:
    piece_cut, doc_cut = cut_patterns(opts)
    with open_input(path, offset) as f:
        buf = bytearray(read_full(f, opts.piece_bytes))  # grows in place while a piece waits for its cut
        eof = len(buf) < opts.piece_bytes
        if not buf and offset == 0:
            raise TokenFileError(path, "empty input: expected text, found 0 bytes")
        first = offset == 0
        while buf:
            cut, shard_end, search = None, False, max(opts.piece_bytes - 1, 0)
            while cut is None:
                m = piece_cut.search(buf, min(search, len(buf)))
                if m is not None:
                    cut = m.end()
                elif eof:
                    cut = len(buf)
                else:  # no cut yet: the piece grows until one comes
                    search = max(len(buf) - 1, 0)
                    more = read_full(f, opts.piece_bytes)
                    eof = len(more) < opts.piece_bytes
                    buf += more
            if opts.shard_bytes is not None:
                limit = opts.shard_bytes - shard_used  # where the shard fills, in buf coordinates
                if limit < cut:
                    m = doc_cut.search(buf, max(limit, 0)) if doc_cut is not None else None
                    if m is not None and m.end() <= cut:
                        cut, shard_end = m.end(), True
                    elif eof and cut == len(buf):
                        shard_end = True  # an input's end always ends a document
            last = eof and cut == len(buf)
            data = bytes(buf[:cut])
            yield Piece(i, str(path), offset, line, data, first, last, shard_end, len(data))
            shard_used = 0 if shard_end else shard_used + len(data)
            offset += len(data)
            line += data.count(b"\n")
            first = False
            buf = buf[cut:]
            if not eof and len(buf) < opts.piece_bytes:
                more = read_full(f, opts.piece_bytes)
                eof = len(more) < opts.piece_bytes
                buf += more


def _parquet_pieces(
    i: int, path: Path, opts: ReadOptions, row: int, column: str | None, shard_used: int
) -> Iterator[Piece]:
    pa = _pyarrow(path, "reading Parquet input")
    import pyarrow.compute as pc

    try:
        pf = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise TokenFileError(path, f"not a Parquet file: {str(e).splitlines()[0]}") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise TokenFileError(path, f"no column {column!r}: expected a string column, found columns {names}")
    n_rows = pf.metadata.num_rows
    if n_rows == 0:
        raise TokenFileError(path, "empty input: expected rows, found 0")
    # skip whole row groups before the resume row, then rows inside the first one read
    groups, first_row = [], 0
    for g in range(pf.num_row_groups):
        size = pf.metadata.row_group(g).num_rows
        if first_row + size > row:
            groups = list(range(g, pf.num_row_groups))
            break
        first_row += size
    batch_rows = max(1, opts.piece_bytes // 512)
    pos = first_row
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[column], row_groups=groups):
        col = batch.column(0)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise TokenFileError(path, f"column {column!r}: expected strings, found {col.type}")
        if pos + len(col) <= row:
            pos += len(col)
            continue
        if pos < row:
            col, pos = col.slice(row - pos), row
        sizes = pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
        while len(col):
            n = len(col)
            shard_end = False
            if opts.shard_bytes is not None:
                filled = (shard_used + sizes.cumsum()) >= opts.shard_bytes
                if filled.any():
                    n, shard_end = int(filled.argmax()) + 1, True
            values = col.slice(0, n).to_pylist()
            nbytes = int(sizes[:n].sum())
            last = pos + n == n_rows
            yield Piece(i, str(path), pos, pos + 1, values, pos == 0, last, shard_end, nbytes)
            shard_used = 0 if shard_end else shard_used + nbytes
            pos += n
            col, sizes = col.slice(n), sizes[n:]
