"""Exceptions the app raises for bad input; the CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class LmtrainError(Exception):
    """A user-facing error: bad flags, a missing file, a config value out of range."""


class OverrideError(LmtrainError, ValueError):
    """A `--set key=value` that names no config field or whose value does not convert to the field's type."""


def no_space_message(err: OSError, output: str | None) -> str:
    """The one line for a write that found the disk full: the file (or the command's output directory), what is
    free there, the fix. An error that already says all that (trainloop's DiskFullError) is kept as it is."""
    import shutil
    from pathlib import Path

    if err.strerror is None:
        return str(err)
    where = err.filename or output or "the output"
    try:
        probe = Path(where).resolve()
        while not probe.exists():
            probe = probe.parent
        free = f"{shutil.disk_usage(probe).free / 1e6:,.1f} MB free there now"
    except OSError:
        free = "free space unknown"
    return f"no space left on device writing {where} ({err.strerror}; {free}): free some space and run it again"
