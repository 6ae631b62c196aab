"""Atomic, locked writing of token files: temp file in the target directory, fsync, rename."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from tokbin.errors import TokenFileError
from tokbin.fileformat import HEADER_SIZE, OFFSET_DTYPE, VERSION, Header, dtype_for_vocab, new_data_hash

if TYPE_CHECKING:
    from tokbin.tokenfile import TokenFile


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` with ``flock(LOCK_EX | LOCK_NB)``; a second writer fails at once instead of waiting.

    The lock file is left in place afterwards: unlinking it would let a waiting writer lock a dead inode.
    """
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TokenFileError(
                path, f"another writer holds {lock_path.name}: expected an unlocked output, found it locked"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the flock


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a temp file next to ``path``; on success fsync it, rename it over ``path`` and fsync the directory.

    On any exception (or a kill) nothing appears under ``path``; the temp file is removed when Python can still run.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise TokenFileError(path, f"output directory {path.parent} does not exist")
    with exclusive_lock(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w+b") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # makes the rename itself durable
        finally:
            os.close(dir_fd)


def _as_docs(docs: Iterable[np.ndarray] | np.ndarray) -> Iterable[np.ndarray]:
    if isinstance(docs, np.ndarray):
        if docs.ndim != 1:
            raise ValueError(f"docs: a single array must be 1-D (one document), got shape {docs.shape}")
        return (docs,)
    return docs


def _checked(doc: object, index: int, vocab_size: int, dtype: np.dtype, path: Path) -> np.ndarray:
    arr = np.asarray(doc)
    if arr.ndim != 1:
        raise TokenFileError(path, f"document {index}: expected a 1-D array of ids, found shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise TokenFileError(path, f"document {index}: expected integer ids, found dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenFileError(
            path,
            f"document {index}: id {bad} does not fit: expected 0 <= id < vocab_size {vocab_size} ({dtype.name})",
        )
    return np.ascontiguousarray(arr, dtype=dtype)


def write_tokens(
    path: str | os.PathLike,
    docs: Iterable[np.ndarray] | np.ndarray,
    *,
    vocab_size: int,
    eos_id: int | None = None,
    tokenizer_sha256: str | None = None,
) -> TokenFile:
    """Write documents of token ids to a token file atomically and return it opened for reading.

    ``docs`` is one 1-D array (a single document) or an iterable of 1-D integer arrays, consumed once, in a
    streaming fashion. The dtype is uint16 when ``vocab_size <= 65536`` and uint32 otherwise; an id outside
    ``[0, vocab_size)`` raises TokenFileError and leaves no file. No EOS is added here (``encode_files`` adds it).

    Example::

        tf = write_tokens("ids.bin", [np.array([5, 6, 2]), np.array([7, 2])], vocab_size=1000, eos_id=2)
        assert tf.n_tokens == 5 and tf.n_docs == 2
    """
    from tokbin.tokenfile import TokenFile

    path = Path(path)
    dtype = dtype_for_vocab(vocab_size)
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id must be in [0, vocab_size={vocab_size}), got {eos_id}")
    if tokenizer_sha256 is not None and (len(tokenizer_sha256) != 64 or not _is_hex(tokenizer_sha256)):
        raise ValueError(f"tokenizer_sha256 must be 64 hex digits, got {tokenizer_sha256!r}")
    with atomic_output(path) as f:
        f.write(b"\x00" * HEADER_SIZE)  # placeholder until the counts and checksum are known
        digest = new_data_hash()
        lengths: list[int] = []
        n_tokens = 0
        for i, doc in enumerate(_as_docs(docs)):
            arr = _checked(doc, i, vocab_size, dtype, path)
            view = memoryview(arr).cast("B")
            f.write(view)
            digest.update(view)
            lengths.append(arr.size)
            n_tokens += arr.size
        if n_tokens == 0:
            raise TokenFileError(path, "no tokens to write: expected at least one id, found empty input")
        pad = (-(HEADER_SIZE + n_tokens * dtype.itemsize)) % 8
        f.write(b"\x00" * pad)
        offsets = np.zeros(len(lengths) + 1, dtype=OFFSET_DTYPE)
        np.cumsum(lengths, out=offsets[1:])
        f.write(offsets.tobytes())
        digest.update(offsets.tobytes())
        header = Header(
            version=VERSION,
            itemsize=dtype.itemsize,
            vocab_size=vocab_size,
            n_tokens=n_tokens,
            n_docs=len(lengths),
            eos_id=eos_id,
            tokenizer_sha256=tokenizer_sha256,
            data_sha256=digest.hexdigest(),
        )
        f.seek(0)
        f.write(header.pack())
    return TokenFile(path)


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True
