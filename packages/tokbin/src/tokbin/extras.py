"""The ``pip install`` line for an extra (pyarrow for Parquet input), worded for where the package came from."""

from __future__ import annotations

import json
import os
from pathlib import Path

DIST = "lmtools-tokbin"  # the distribution name (the import name `tokbin` is another project's on PyPI)


def install_hint(extra: str, dist: str = DIST) -> str:
    """The ``pip install`` line that adds ``dist``'s ``extra`` from where the user stands: the checkout directory the
    distribution was installed from, when pip recorded one (its ``direct_url.json``; ``-e`` for an editable install),
    else the distribution name. The packages are not on the package index, so a name alone works only for a wheel
    installed some other way.

    Example (a distribution that is not installed at all):
        >>> install_hint("hf", "no-such-distribution")
        "pip install 'no-such-distribution[hf]'"
    """
    source, editable = _installed_from(dist)
    if source is None:
        return f"pip install '{dist}[{extra}]'"
    try:
        shown = os.path.relpath(source)
        shown = shown if not shown.startswith("..") else str(source)
    except ValueError:
        shown = str(source)
    return f'pip install {"-e " if editable else ""}"{shown}[{extra}]"'


def _installed_from(dist: str) -> tuple[Path | None, bool]:
    """(the local directory ``dist`` was installed from, whether editably), or (None, False)."""
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        recorded = metadata.distribution(dist).read_text("direct_url.json")
        info = json.loads(recorded or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return None, False
    url = urlparse(str(info.get("url", "")))
    if url.scheme != "file" or "dir_info" not in info:
        return None, False
    source = Path(unquote(url.path))
    if not (source / "pyproject.toml").is_file():
        return None, False  # built from a directory that is gone
    return source, bool(info["dir_info"].get("editable"))
