"""Stale locks of torch's C++ extension builds, which make every later DeepSpeed start wait forever.

DeepSpeed JIT-builds its ops (``deepspeed_shm_comm`` on CPU, ``cpu_adam``, ...) through
``torch.utils.cpp_extension.load``, which serialises builds with a ``FileBaton``: the builder creates
``<extensions root>/<op>/lock`` with ``O_CREAT | O_EXCL``, keeps it open while it compiles and removes it when done;
every other process polls until the file is gone, with no timeout and no message. The lock records nothing (no pid,
no host), so a build killed midway leaves a lock that nobody will remove and every later start hangs.

Without an owner in the file, a lock is judged by who holds it open: the builder keeps its descriptor for the whole
build, so a lock that no process on this machine has open is left by a build that died, provided the builder could
only have run here. Where the extensions root is on a network filesystem (a home shared by several nodes), a builder
on another node would not show, so such a lock counts as stale only once it is older than ``STALE_AFTER_S`` (a build
takes minutes at most). Processes whose descriptors this user cannot read (another user's) are not seen either: the
extensions root is per user.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton file in each extension's build directory
STALE_AFTER_S = 30 * 60.0  # on a network filesystem: no build of an op runs this long
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
                                 "glusterfs", "fuse.sshfs", "fuse.glusterfs", "9p", "afs", "panfs"})  # fmt: skip


@dataclass(frozen=True)
class ExtensionLock:
    """One lock file found, with the verdict: ``holders`` are the pids that have it open (a build in progress)."""

    path: Path
    age_s: float
    holders: tuple[int, ...]
    network: bool

    @property
    def stale(self) -> bool:
        """No process here holds it and, on a network filesystem, it is older than any build takes."""
        return not self.holders and (not self.network or self.age_s >= STALE_AFTER_S)


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else ``<user cache>/torch_extensions/py<XY>_<acc>``
    (the directory ``torch.utils.cpp_extension`` itself picks for this Python and torch build)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _open_by(paths: set[Path]) -> dict[Path, list[int]]:
    """pid lists of the processes on this machine (those whose descriptors we may read) that have ``paths`` open."""
    holders: dict[Path, list[int]] = {p: [] for p in paths}
    wanted = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        wanted[(st.st_dev, st.st_ino)] = p
    if not wanted:
        return holders
    me = os.getpid()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:  # gone, or not ours to read
            continue
        with fds:
            for fd in fds:
                try:
                    st = os.stat(fd.path)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in wanted:
                    holders[wanted[(st.st_dev, st.st_ino)]].append(int(entry.name))
    return holders


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on, from /proc/self/mounts (the longest mount point above it)."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = str(path.resolve())
    best, kind = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def find_extension_locks(root: str | os.PathLike[str] | None = None) -> list[ExtensionLock]:
    """Every ``<root>/<op>/lock`` present, judged (module docstring); ``root`` defaults to :func:`extensions_root`.

    Example:
        >>> import tempfile
        >>> root = tempfile.TemporaryDirectory()
        >>> (Path(root.name) / "deepspeed_shm_comm").mkdir()
        >>> (Path(root.name) / "deepspeed_shm_comm" / "lock").touch()  # what a killed build leaves behind
        >>> [(lock.path.parent.name, lock.stale) for lock in find_extension_locks(root.name)]
        [('deepspeed_shm_comm', True)]
        >>> root.cleanup()
    """
    base = Path(root) if root is not None else extensions_root()
    if not base.is_dir():
        return []
    locks = sorted(p for p in base.glob(f"*/{LOCK_NAME}") if p.is_file() and not p.is_symlink())
    if not locks:
        return []
    holders = _open_by(set(locks))
    network = (_filesystem_type(base) or "") in NETWORK_FILESYSTEMS
    now = time.time()
    found = []
    for lock in locks:
        try:
            age = max(0.0, now - lock.stat().st_mtime)
        except OSError:  # removed meanwhile: a build finished
            continue
        found.append(ExtensionLock(lock, age, tuple(holders.get(lock, [])), network))
    return found


def stale_extension_lock_message(root: str | os.PathLike[str] | None = None) -> str | None:
    """One line naming the stale extension-build lock(s) under ``root`` and the command that removes them, or None
    when there is none: what a DeepSpeed start checks before its ops are built (it would wait forever) and what
    ``lmtrain doctor`` reports.

    Example:
        >>> import tempfile
        >>> root = tempfile.TemporaryDirectory()
        >>> stale_extension_lock_message(root.name) is None
        True
        >>> (Path(root.name) / "cpu_adam").mkdir()
        >>> (Path(root.name) / "cpu_adam" / "lock").touch()
        >>> print(stale_extension_lock_message(root.name))  # doctest: +ELLIPSIS
        stale lock of a torch extension build that was killed: .../cpu_adam/lock (no process has it open...); ...
        >>> root.cleanup()
    """
    stale = [lock for lock in find_extension_locks(root) if lock.stale]
    if not stale:
        return None
    paths = " ".join(str(lock.path) for lock in stale)
    why = "no process has it open" + (
        f", and it is {stale[0].age_s / 60:.0f} minutes old on a network filesystem" if stale[0].network else ""
    )
    return (
        f"stale lock of a torch extension build that was killed: {paths} ({why}); every DeepSpeed start waits on it "
        f"forever: remove it (rm {paths}) and start again, which rebuilds the op"
    )
