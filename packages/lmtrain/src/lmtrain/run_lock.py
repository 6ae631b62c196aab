"""One writer per output directory: `lmtrain train` and `lmtrain prepare` hold DIR/.lmtrain.lock while they run.

The lock is `flock(LOCK_EX | LOCK_NB)` on that file, so a second writer fails at once (one line naming the first's
PID, host and command, which the holder writes into the file) instead of interleaving checkpoints or token files
with it. The kernel drops an flock when its process dies, however it dies, so a crashed or killed run never
blocks the next one; the PID written inside is only for the message, never trusted to decide anything.

Under torchrun only global rank 0 takes the lock: the other ranks of the same job write into the same run
directory on purpose.

Network filesystems: on NFS, Linux emulates flock with a byte-range lock on the whole file held by the server, so
the lock holds between machines only where the mount supports locking (NFSv4, or NFSv3 with lockd; not a `nolock`
mount, where each client sees only its own locks). The lock of a machine that dies (rather than a process) is freed
by the server: on NFSv4 when the client's lease expires (90 s by default on a Linux server), on NFSv3 only when that
machine boots again and its statd tells the server. Filesystems without locks refuse with ENOLCK: a one-line error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from types import TracebackType

from lmtrain.errors import LmtrainError

LOCK_FILE = ".lmtrain.lock"
_ATTEMPTS = 20  # a holder releasing while we open can make us start over; never forever


def global_rank() -> int:
    """This process's rank in a torchrun / deepspeed job (RANK), 0 outside one."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class DirectoryLock:
    """Hold ``directory/.lmtrain.lock`` for the life of a ``with`` block; the directory is created when missing.

    A directory this lock created and left holding nothing but the lock file (the command failed before writing
    anything) is removed again on release, so a refused command leaves no trace.

    Example (a second writer on the same directory is refused in one line):
        >>> import os, tempfile
        >>> from lmtrain.errors import LmtrainError
        >>> runs = tempfile.TemporaryDirectory()
        >>> run = os.path.join(runs.name, "demo")
        >>> with DirectoryLock(run, "lmtrain train"):
        ...     try:
        ...         with DirectoryLock(run, "lmtrain prepare"):
        ...             pass
        ...     except LmtrainError as exc:
        ...         print(exc)  # doctest: +ELLIPSIS
        --out .../demo: in use by `lmtrain train` (pid ... on host ..., since ...) (lock .../demo/.lmtrain.lock): ...
        >>> os.path.exists(run)  # created by the lock and left empty: removed again
        False
        >>> runs.cleanup()
    """

    def __init__(self, directory: str | os.PathLike, command: str, *, flag: str = "--out") -> None:
        self.directory = Path(directory)
        self.command = command
        self.flag = flag
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> DirectoryLock:
        for _ in range(_ATTEMPTS):
            self._make_directory()
            fd = self._open()
            if fd is None:
                continue  # a releasing holder removed the directory it had created between our two calls
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise LmtrainError(
                    f"{self.flag} {self.directory}: in use by {holder} (lock {self.path}): one writer per directory; "
                    f"wait for it to finish, stop it, or choose another {self.flag}"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.ENOLCK:
                    raise LmtrainError(
                        f"{self.flag} {self.directory}: this filesystem does not support file locks (ENOLCK; NFS "
                        "mounted with nolock?): put the output on a filesystem with locking"
                    ) from None
                raise
            # A releasing holder may have removed the file between our open and our lock: then we hold a lock on a
            # file nobody else can open, and must start over on the path's current file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise LmtrainError(f"{self.flag} {self.directory}: its lock file keeps disappearing; retry the command")
        self._fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays, emptied, unless this lock created the directory and it
        holds nothing else."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            if self._created and [p.name for p in self.directory.iterdir()] == [LOCK_FILE]:
                self.path.unlink()  # while still locked: a waiting opener then sees another file and starts over
                with contextlib.suppress(OSError):
                    self.directory.rmdir()
        except OSError:
            pass  # the lock itself is released below whatever happened to the file
        finally:
            os.close(fd)

    def _make_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise LmtrainError(f"{self.flag} {d}: is a file, expected a directory; choose another {self.flag}")
        if d.is_dir():
            return
        try:
            d.mkdir(parents=True)
        except FileExistsError:
            return  # made by a concurrent command: the lock decides which of us writes
        except NotADirectoryError:
            raise LmtrainError(
                f"{self.flag} {d}: a parent of it is a file, expected directories; choose another {self.flag}"
            ) from None
        except OSError as exc:
            raise LmtrainError(f"{self.flag} {d}: cannot create the directory: {exc.strerror}") from None
        self._created = True

    def _open(self) -> int | None:
        try:
            # O_NOFOLLOW: a symbolic link in place of the lock is refused, never opened (and emptied) through.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LmtrainError(
                    f"{self.flag} {self.directory}: its lock file {LOCK_FILE} is a symbolic link: a run writes only "
                    "inside its directory; remove the link"
                ) from None
            if exc.errno == errno.ENXIO:  # a FIFO without a reader, opened non-blocking
                raise LmtrainError(f"{self.flag} {self.directory}: its lock file {LOCK_FILE} is a FIFO, not a file; "
                                   "remove it") from None  # fmt: skip
            raise LmtrainError(
                f"{self.flag} {self.directory}: cannot create its lock file {LOCK_FILE}: {exc.strerror}; "
                "expected a writable directory"
            ) from None
        # Hard links are not stopped by O_NOFOLLOW: the lock is emptied and written (the holder's record), so a lock
        # that is another name of some file, or no regular file, is refused before either happens.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            links = f"has {st.st_nlink} hard links (the same file under other names, which the lock would empty)"
            what = links if stat.S_ISREG(st.st_mode) else "is not a regular file"
            raise LmtrainError(
                f"{self.flag} {self.directory}: its lock file {LOCK_FILE} {what}: a run writes only its own files; "
                "remove it"
            )
        os.set_blocking(fd, True)
        return fd


def _read_holder(fd: int) -> str:
    """'`lmtrain train` (pid 123 on host node1, since ...)' from the holder's record, or what can be said without."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return f"`{record['command']}` (pid {int(record['pid'])} on host {record['host']}, since {record['started']})"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        # The holder has locked but not yet written its record (a few microseconds), or wrote something else.
        return "another process (its pid and host are not recorded yet)"


def output_lock(command: str, directory: str | os.PathLike | None) -> contextlib.AbstractContextManager:
    """The lock a command that writes into `directory` holds: a DirectoryLock on global rank 0, nothing on the other
    ranks of a distributed job (they write into the same directory on purpose) or without a directory."""
    if directory is None or global_rank() != 0:
        return contextlib.nullcontext()
    return DirectoryLock(directory, f"lmtrain {command}")
