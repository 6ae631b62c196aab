"""Optional dependencies: import one, or fail with one line that names the extra which installs it."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType

DIST = "lmtools-trainloop"  # the distribution name (the import name `trainloop` is another project's on PyPI)


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message is the ``pip install`` line that adds it."""


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


def import_extra(module: str, extra: str, purpose: str, dist: str = DIST) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` saying what needs it and which extra installs it.

    Only the module itself (or its top-level package) being absent is translated; an installed package that fails
    on one of its own imports keeps its original error, which names the real cause.

    Example (`None` in `sys.modules` makes an import fail as if the module were not installed):
        >>> import sys
        >>> from unittest import mock
        >>> with mock.patch.dict(sys.modules, deepspeed=None):
        ...     try:
        ...         import_extra("deepspeed", "deepspeed", "the DeepSpeed engine")
        ...     except MissingExtraError as exc:
        ...         print(exc)  # doctest: +ELLIPSIS
        the DeepSpeed engine needs deepspeed, which is not installed: pip install ...[deepspeed]...
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or (exc.name != module and not module.startswith(exc.name + ".")):
            raise
        top = module.split(".")[0]
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: {install_hint(extra, dist)}") from exc
