"""Optional dependencies: the ``hf`` extra (transformers, peft) for export to Hugging Face formats, the ``gguf``
extra for export to llama.cpp's GGUF; import them or fail in one line."""

from __future__ import annotations

import importlib
from types import ModuleType

DIST = "lmtools-lmcore"  # the distribution name (the import name `lmcore` is another project's on PyPI)
HF_MODULES = ("transformers", "peft")
# extra -> the top-level modules it provides
EXTRAS = {"hf": HF_MODULES, "gguf": ("gguf", "numpy")}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message is the ``pip install`` line that adds it."""


def import_hf(module: str, purpose: str, dist: str = DIST) -> ModuleType:
    """Import ``transformers`` or ``peft`` (or one of their submodules) for ``purpose``, or raise
    :class:`MissingExtraError`: ``<purpose> needs transformers, which is not installed: pip install '<dist>[hf]'``.

    ``dist`` names the distribution whose ``hf`` extra the message tells to install (the app passes ``"lmtrain"``).
    An installed library that fails on one of its own imports keeps its original error.

    Example (`None` in `sys.modules` makes an import fail as if the module were not installed):
        >>> import sys
        >>> from unittest import mock
        >>> with mock.patch.dict(sys.modules, peft=None):
        ...     import_hf("peft", "the PEFT adapter export")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmcore.extras.MissingExtraError: the PEFT adapter export needs peft, ...: pip install 'lmtools-lmcore[hf]'
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
        raise MissingExtraError(
            f"{purpose} needs {top}, which is not installed: pip install '{dist}[{extra}]'"
        ) from exc
