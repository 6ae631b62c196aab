"""Optional dependencies: the ``hf`` extra (transformers, peft) for export to Hugging Face formats, the ``gguf``
extra for export to llama.cpp's GGUF; import them or fail in one line."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType

DIST = "lmtools-lmcore"  # the distribution name (the import name `lmcore` is another project's on PyPI)
HF_MODULES = ("transformers", "peft")
# extra -> the top-level modules it provides
EXTRAS = {"hf": HF_MODULES, "gguf": ("gguf", "numpy")}
# The hf extra pins transformers 5.24+ (its SentencePiece converter: 5.20.2, the newest release for Python 3.10, leaves
# the document-start token out), which is released for Python 3.11 and later only.
HF_MIN_PYTHON = (3, 11)


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message is the ``pip install`` line that adds it."""


def import_hf(module: str, purpose: str, dist: str = DIST) -> ModuleType:
    """Import ``transformers`` or ``peft`` (or one of their submodules) for ``purpose``, or raise
    :class:`MissingExtraError`: ``<purpose> needs transformers, which is not installed: pip install ...`` (the
    line :func:`install_hint` gives; on Python 3.10, where the extra cannot install, what :func:`extra_hint` says).

    ``dist`` names the distribution whose ``hf`` extra the message tells to install (the app passes ``"lmtrain"``).
    An installed library that fails on one of its own imports keeps its original error.

    Example (`None` in `sys.modules` makes an import fail as if the module were not installed):
        >>> import sys
        >>> from unittest import mock
        >>> with mock.patch.dict(sys.modules, peft=None):
        ...     import_hf("peft", "the PEFT adapter export")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmcore.extras.MissingExtraError: the PEFT adapter export needs peft, which is not installed: ...
    """
    return import_extra(module, "hf", purpose, dist)


def import_extra(module: str, extra: str, purpose: str, dist: str = DIST) -> ModuleType:
    """Import `module`, one that the extra `extra` provides, for `purpose`, or raise :class:`MissingExtraError`
    naming ``pip install '<dist>[<extra>]'`` (see `import_hf`).

    Example:
        >>> import_extra("json", "gguf", "a test")
        Traceback (most recent call last):
        ValueError: import_extra('json'): the gguf extra provides gguf, numpy only
    """
    top = module.split(".")[0]
    if top not in EXTRAS[extra]:
        raise ValueError(f"import_extra({module!r}): the {extra} extra provides {', '.join(EXTRAS[extra])} only")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or (exc.name != module and not module.startswith(exc.name + ".")):
            raise
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: {extra_hint(extra, dist)}") from exc


def extra_hint(extra: str, dist: str = DIST, python: tuple[int, ...] | None = None) -> str:
    """How to get `extra`: `install_hint`'s pip line, or, for the hf extra on a Python older than 3.11 (`python`,
    default this one), that it needs a newer Python, since no transformers release it admits installs there.

    Example:
        >>> extra_hint("hf", "lmtools-lmcore", python=(3, 10))  # doctest: +ELLIPSIS
        'its hf extra needs Python 3.11 or newer (transformers 5.24+), this is Python 3.10: ...'
    """
    version = tuple((python or sys.version_info)[:2])
    if extra == "hf" and version < HF_MIN_PYTHON:
        return (
            f"its hf extra needs Python {'.'.join(map(str, HF_MIN_PYTHON))} or newer (transformers 5.24+), this is "
            f"Python {'.'.join(map(str, version))}: use a Python 3.11+ environment"
        )
    return install_hint(extra, dist)


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
