"""Exceptions the app raises for bad input; the CLI prints them as one line and exits with status 2."""

from __future__ import annotations

import errno
import os
import re


class LmtrainError(Exception):
    """A user-facing error: bad flags, a missing file, a config value out of range."""


class OverrideError(LmtrainError, ValueError):
    """A `--set key=value` that names no config field or whose value does not convert to the field's type."""


# The errors of a write that the filesystem refuses for good: a full disk or quota, the file size limit of the
# process (ulimit -f), a read-only filesystem. The CLI prints them as one line (write_failure_message).
def in_flags(message: str) -> str:
    """A library's message (trainloop's, lmcore's) in the words of the command line: its arguments become the flags
    that set them (``resume=True`` -> ``--resume``, ``overwrite=True`` -> ``--overwrite``, ``engine='fsdp'`` ->
    ``--engine fsdp``).

    Example:
        >>> in_flags("resume them (resume=True) or start over (overwrite=True); resume with engine='fsdp'")
        'resume them (--resume) or start over (--overwrite); resume with --engine fsdp'
    """
    message = re.sub(r"(?<![\w.])resume=True\b", "--resume", message)
    message = re.sub(r"(?<![\w.])overwrite=True\b", "--overwrite", message)
    return re.sub(r"(?<![\w.])engine='(\w+)'", r"--engine \1", message)


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def write_failure_message(err: OSError, output: str | os.PathLike | None) -> str:
    """The one line for a write the filesystem refused (:data:`WRITE_ERRNOS`): the file (or the command's output
    directory), the cause with what is free or the limit, the fix. An error that already says all that (trainloop's
    DiskFullError and WriteFailedError, made from a message alone) is kept as it is.

    Example:
        >>> import errno
        >>> err = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/g.jsonl")
        >>> print(write_failure_message(err, None))  # doctest: +ELLIPSIS
        read-only filesystem: cannot write /mnt/ro/g.jsonl (Read-only file system): choose an output on a writable ...
    """
    import shutil
    from pathlib import Path

    if err.strerror is None:
        return str(err)
    where = err.filename or output or "the output"
    if err.errno == errno.EROFS:
        return f"read-only filesystem: cannot write {where} ({err.strerror}): choose an output on a writable filesystem"
    if err.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
        return (f"file too large writing {where} ({err.strerror}): the file size limit of this process is {shown} "
                "(ulimit -f); raise it (ulimit -f unlimited) and run it again")  # fmt: skip
    try:
        probe = Path(where).resolve()
        while not probe.exists():
            probe = probe.parent
        free = f"{shutil.disk_usage(probe).free / 1e6:,.1f} MB free there now"
    except OSError:
        free = "free space unknown"
    return f"no space left on device writing {where} ({err.strerror}; {free}): free some space and run it again"


def no_space_message(err: OSError, output: str | None) -> str:
    """The one line for a write that found the disk full (or hit another of :data:`WRITE_ERRNOS`): see
    :func:`write_failure_message`."""
    return write_failure_message(err, output)


def refuse_output_over_input(
    output: str | os.PathLike, inputs: dict[str, str | os.PathLike | None], *, flag: str
) -> None:
    """Refuse, in one line, an output that is one of the command's inputs: the same path once resolved (links
    followed), or the same file under another name (a hard link: same device and inode). ``inputs`` maps each
    input's flag to its path (None: not given). Call it before any work, so the input is never replaced.

    Example:
        >>> import tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> prompts = os.path.join(work.name, "p.jsonl")
        >>> _ = open(prompts, "w").write("{}")
        >>> refuse_output_over_input(os.path.join(work.name, "g.jsonl"), {"--prompts": prompts}, flag="--generations")
        >>> os.link(prompts, os.path.join(work.name, "same.jsonl"))
        >>> refuse_output_over_input(os.path.join(work.name, "same.jsonl"), {"--prompts": prompts},
        ...                          flag="--generations")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: --generations .../same.jsonl: is --prompts .../p.jsonl (the same file): ...
        >>> work.cleanup()
    """
    from pathlib import Path

    out = Path(output)
    for name, given in inputs.items():
        if given is None:
            continue
        source = Path(given)
        same = out.resolve() == source.resolve()
        if not same and out.exists() and source.exists():
            try:
                same = os.path.samefile(out, source)
            except OSError:
                same = False
        if same:
            raise LmtrainError(
                f"{flag} {output}: is {name} {given} (the same file): the output would replace the input; choose "
                f"another {flag}"
            )
