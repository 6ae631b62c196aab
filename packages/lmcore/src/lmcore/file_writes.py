"""How lmcore writes files: never through a symbolic or hard link, atomically, with the mode the umask gives.

safetensors' ``save_file`` writes a temporary file of its own and renames it over the target, which keeps a kill
from leaving half a file, but the temporary file is created 0600: a weights or adapter file came out unreadable to
the group and others whatever the umask said. :func:`write_safetensors` gives it the umask's mode once renamed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def created_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 under umask 022).

    Example:
        >>> old = os.umask(0o027); mode = created_mode(); _ = os.umask(old)
        >>> oct(mode)
        '0o640'
    """
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


def refuse_linked(path: str | os.PathLike[str]) -> None:
    """Raise ValueError (one line) when ``path`` is a symbolic link, has other hard links (``st_nlink > 1``) or is
    not a regular file: writing there would change or replace a file that is not ours.

    Example:
        >>> d = tempfile.TemporaryDirectory()
        >>> os.symlink("/etc/hostname", os.path.join(d.name, "adapters.safetensors"))
        >>> refuse_linked(os.path.join(d.name, "adapters.safetensors"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../adapters.safetensors: is a symbolic link: ...
        >>> d.cleanup()
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    fix = "remove it (a file is written only as a file of its own), or write elsewhere"
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path}: is a symbolic link: expected a file or nothing; {fix}")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: is not a regular file: expected a file or nothing; {fix}")
    if st.st_nlink > 1:
        raise ValueError(f"{path}: has {st.st_nlink} hard links (the same file under other names); {fix}")


def _give_umask_mode(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, created_mode())
    finally:
        os.close(fd)


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> Path:
    """safetensors' ``save_file`` (a temporary file renamed into place), never over a link, with the umask's mode.

    Example:
        >>> d = tempfile.TemporaryDirectory()
        >>> old = os.umask(0o022)
        >>> path = write_safetensors({"w": torch.zeros(2)}, os.path.join(d.name, "w.safetensors"))
        >>> _ = os.umask(old)
        >>> oct(stat.S_IMODE(path.stat().st_mode))
        '0o644'
        >>> d.cleanup()
    """
    path = Path(path)
    refuse_linked(path)
    save_file(tensors, str(path), metadata=metadata)
    _give_umask_mode(path)
    return path


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """``text`` (UTF-8) to ``path`` through a temporary file, fsync and a rename; never over a link, umask's mode."""
    path = Path(path)
    refuse_linked(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), created_mode())  # mkstemp creates 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
