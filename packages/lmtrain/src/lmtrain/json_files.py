"""JSON files and copies written so that a kill, a power cut or a full disk never leaves half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object or raise LmtrainError naming the file and what it should be."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LmtrainError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LmtrainError(f"{path}: unreadable {what}: {exc}") from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file, fsync and a rename, so a kill or a power cut never leaves half a file;
    a failed write (a full disk) removes the temporary file and raises an OSError that names ``path``."""
    from trainloop.checkpoint import open_new, refuse_linked

    refuse_linked(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a leftover, or a link planted there: the link itself goes
        with open_new(tmp) as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def copy_file(source: Path, target: Path) -> None:
    """Copy through a temporary file and a rename, so a kill never leaves half a file."""
    from trainloop.checkpoint import open_new

    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        with open_new(tmp, "wb") as f:
            f.write(source.read_bytes())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
