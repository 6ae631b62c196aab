"""Optional dependencies: import one, or fail with one line that names the extra which installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

DIST = "lmtools-trainloop"  # the distribution name (the import name `trainloop` is another project's on PyPI)


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message is the ``pip install`` line that adds it."""


def install_hint(extra: str, dist: str = DIST) -> str:
    """The command that installs an extra, e.g. ``pip install 'lmtools-trainloop[deepspeed]'``."""
    return f"pip install '{dist}[{extra}]'"


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
        ...         print(exc)
        the DeepSpeed engine needs deepspeed, which is not installed: pip install 'lmtools-trainloop[deepspeed]'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or (exc.name != module and not module.startswith(exc.name + ".")):
            raise
        top = module.split(".")[0]
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: {install_hint(extra, dist)}") from exc
