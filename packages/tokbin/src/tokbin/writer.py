"""Atomic, locked writing of token files: temp file in the target directory, fsync, rename."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from tokbin.errors import TokenFileError
from tokbin.fileformat import HEADER_SIZE, OFFSET_DTYPE, VERSION, Header, dtype_for_vocab, new_data_hash

if TYPE_CHECKING:
    from tokbin.tokenfile import TokenFile


def created_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 under umask 022), for files made by mkstemp."""
    try:
        with open("/proc/self/status") as f:  # reads the umask without changing it (Linux)
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore, the only portable way to read it
    os.umask(mask)
    return 0o666 & ~mask


# The errors of a write that the filesystem refuses for good: full disk or quota, file size limit, read-only.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def refuse_linked(path: Path) -> None:
    """Raise TokenFileError when ``path`` is a symbolic link, a file with other hard links (``st_nlink > 1``) or
    anything but a regular file: an output written there would replace or change a file that is not ours.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> os.symlink("/etc/hostname", os.path.join(d.name, "tokenizer.model"))
        >>> refuse_linked(Path(d.name) / "tokenizer.model")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        tokbin.errors.TokenFileError: .../tokenizer.model: is a symbolic link to /etc/hostname: ...
        >>> d.cleanup()
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    fix = "remove it (an output is written only as a file of its own), or choose another output"
    if stat.S_ISLNK(st.st_mode):
        raise TokenFileError(path, f"is a symbolic link to {os.readlink(path)}: expected a file or nothing; {fix}")
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(path, f"is not a regular file: expected a file or nothing; {fix}")
    if st.st_nlink > 1:
        raise TokenFileError(
            path, f"has {st.st_nlink} hard links (the same file under other names): expected a file of its own; {fix}"
        )


def write_failure(path: Path, exc: OSError) -> TokenFileError | None:
    """One TokenFileError for a write to ``path`` refused with ENOSPC, EDQUOT, EFBIG or EROFS, naming the cause and
    the fix; None for other errors."""
    if exc.errno not in _WRITE_ERRNOS:
        return None
    if exc.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
        return TokenFileError(path, f"file too large: the file size limit of this process is {shown} (ulimit -f); "
                                    "raise it (ulimit -f unlimited) and run again")  # fmt: skip
    if exc.errno == errno.EROFS:
        return TokenFileError(path, "read-only filesystem: choose an output on a writable filesystem")
    try:
        free = f"{shutil.disk_usage(path.parent).free / 1e6:,.1f} MB free there now"
    except OSError:
        free = "free space unknown"
    return TokenFileError(path, f"no space left on device ({exc.strerror}; {free}): free some space and run again")


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` with ``flock(LOCK_EX | LOCK_NB)``; a second writer fails at once instead of waiting.

    The lock file is left in place afterwards: unlinking it would let a waiting writer lock a dead inode. A symbolic
    link in its place is refused, never followed (creating the file at its target).
    """
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TokenFileError(lock_path, "is a symbolic link: expected the output's lock file; remove it") from None
        raise write_failure(lock_path, exc) or exc from None
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


def temp_pattern(path: Path) -> re.Pattern[str]:
    """Names of the temp files ``atomic_output`` makes for ``path``: ``.<name>.<8 mkstemp characters>.tmp``."""
    return re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")


def remove_stale_temps(path: Path) -> int:
    """Remove the temp files of writers of ``path`` that died (SIGKILL, power loss); return how many.

    A writer holds ``flock`` on its temp file while it writes and the kernel drops it when the process ends, so a
    temp file that can be locked has no live writer; one that cannot is left alone.
    """
    removed = 0
    pattern = temp_pattern(path)
    for entry in os.scandir(path.parent):
        if not pattern.fullmatch(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone already, or a link: not a temp file this module made
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live writer's
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, lock: bool = True) -> Iterator[BinaryIO]:
    """Yield a temp file next to ``path``; on success fsync it, rename it over ``path`` and fsync the directory.

    A ``path`` that is a symbolic link, has other hard links or is not a regular file is refused (``refuse_linked``)
    before anything is written; a write the filesystem refuses (full, file size limit, read-only) is one
    TokenFileError naming ``path`` (``write_failure``).

    On any exception nothing appears under ``path`` and the temp file is removed; after a kill the temp file stays
    until the next locked write to ``path`` removes it (``remove_stale_temps``). The file gets the mode the umask
    gives. ``lock=False`` is for callers that hold a lock of their own (and clear their directory's temp files).
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise TokenFileError(path, f"output directory {path.parent} does not exist")
    refuse_linked(path)
    with exclusive_lock(path) if lock else contextlib.nullcontext():
        if lock:
            remove_stale_temps(path)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise write_failure(path, exc) or exc from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # marks the temp file live: see remove_stale_temps
            os.fchmod(fd, created_mode())  # mkstemp creates 0600
            with os.fdopen(fd, "w+b") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            refuse_linked(path)  # a link put there while we wrote
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            failure = write_failure(path, exc)
            if failure is None:
                raise
            raise failure from None
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


class _Discarded(Exception):
    pass


class TokenWriter:
    """Streams token ids into a new token file: ``write`` ids, ``end_document`` after each document.

    Memory stays flat whatever the size: ids go straight to a temp file next to ``path`` and the document offsets
    to an unnamed spool file, appended at the end. Nothing appears under ``path`` unless the ``with`` block ends
    without an exception; then the file is renamed into place and ``token_file`` opens it.

    Example::

        with TokenWriter("ids.bin", vocab_size=1000, eos_id=2) as w:
            w.write(np.array([5, 6, 2]))
            w.end_document()
        w.token_file.n_docs  # 1
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        vocab_size: int,
        eos_id: int | None = None,
        tokenizer_sha256: str | None = None,
        lock: bool = True,
    ) -> None:
        self.path = Path(path)
        self.dtype = dtype_for_vocab(vocab_size)
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id must be in [0, vocab_size={vocab_size}), got {eos_id}")
        if tokenizer_sha256 is not None and (len(tokenizer_sha256) != 64 or not _is_hex(tokenizer_sha256)):
            raise ValueError(f"tokenizer_sha256 must be 64 hex digits, got {tokenizer_sha256!r}")
        self.vocab_size, self.eos_id, self.tokenizer_sha256, self._lock = vocab_size, eos_id, tokenizer_sha256, lock
        self.n_tokens = self.n_docs = self._last_end = 0
        self.token_file: TokenFile | None = None
        self._discard = False

    def __enter__(self) -> TokenWriter:
        self._stack = contextlib.ExitStack()
        try:
            self._f = self._stack.enter_context(atomic_output(self.path, lock=self._lock))
            self._offsets = self._stack.enter_context(tempfile.TemporaryFile(dir=self.path.parent))
        except BaseException:
            self._stack.close()
            raise
        self._f.write(b"\x00" * HEADER_SIZE)  # placeholder until the counts and checksum are known
        self._digest = new_data_hash()
        self._pending: list[int] = [0]
        return self

    def write(self, ids: np.ndarray) -> None:
        """Append ids (a 1-D integer array) to the current document."""
        arr = _checked(ids, self.n_docs, self.vocab_size, self.dtype, self.path)
        view = arr.data.cast("B")
        self._f.write(view)
        self._digest.update(view)
        self.n_tokens += arr.size

    def end_document(self) -> None:
        """End the current document (a document may be empty)."""
        self._pending.append(self.n_tokens)
        self.n_docs += 1
        self._last_end = self.n_tokens
        if len(self._pending) >= 1 << 16:
            self._spool()

    def write_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``ids`` made of whole documents of ``lengths`` tokens (the first one ends the current document)."""
        self.write(ids)
        ends = (self.n_tokens - ids.size) + np.cumsum(lengths, dtype=np.int64)
        self._pending.extend(ends.tolist())
        self.n_docs += len(lengths)
        self._last_end = int(ends[-1]) if len(ends) else self._last_end
        if len(self._pending) >= 1 << 16:
            self._spool()

    def discard(self) -> None:
        """Leave no file when the ``with`` block ends (the temp file is removed)."""
        self._discard = True

    def _spool(self) -> None:
        self._offsets.write(np.asarray(self._pending, dtype=OFFSET_DTYPE).tobytes())
        self._pending = []

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._discard and exc_type is None:
            try:
                raise _Discarded
            except _Discarded:
                self._stack.__exit__(*sys.exc_info())
            return
        try:
            if exc_type is None:
                self._finish()
        except BaseException:
            self._stack.__exit__(*sys.exc_info())
            raise
        self._stack.__exit__(exc_type, exc, tb)
        if exc_type is None:
            from tokbin.tokenfile import TokenFile

            self.token_file = TokenFile(self.path)

    def _finish(self) -> None:
        if self.n_tokens == 0:
            raise TokenFileError(self.path, "no tokens to write: expected at least one id, found empty input")
        if self._last_end != self.n_tokens or self.n_docs == 0:
            self.end_document()  # ids after the last end_document form a last document
        self._spool()
        f = self._f
        f.write(b"\x00" * ((-(HEADER_SIZE + self.n_tokens * self.dtype.itemsize)) % 8))
        self._offsets.seek(0)
        for chunk in iter(lambda: self._offsets.read(1 << 20), b""):
            f.write(chunk)
            self._digest.update(chunk)
        header = Header(
            version=VERSION,
            itemsize=self.dtype.itemsize,
            vocab_size=self.vocab_size,
            n_tokens=self.n_tokens,
            n_docs=self.n_docs,
            eos_id=self.eos_id,
            tokenizer_sha256=self.tokenizer_sha256,
            data_sha256=self._digest.hexdigest(),
        )
        f.seek(0)
        f.write(header.pack())


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

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> out = tempfile.TemporaryDirectory()
        >>> tf = write_tokens(f"{out.name}/ids.bin", [np.array([5, 6, 2]), np.array([7, 2])], vocab_size=1000, eos_id=2)
        >>> tf.n_tokens, tf.n_docs, tf.dtype
        (5, 2, dtype('uint16'))
        >>> tf.tokens.tolist(), tf.doc_offsets.tolist()
        ([5, 6, 2, 7, 2], [0, 3, 5])
        >>> out.cleanup()
    """
    with TokenWriter(path, vocab_size=vocab_size, eos_id=eos_id, tokenizer_sha256=tokenizer_sha256) as w:
        for doc in _as_docs(docs):
            w.write(doc)
            w.end_document()
    assert w.token_file is not None  # opened when the with block ended without an exception
    return w.token_file


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True
