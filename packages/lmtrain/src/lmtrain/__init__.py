"""The integration app: prepare, train, evaluate, generate, preflight checks and a demo for ALiBi GPT models.

``lmtrain.prepare(...)``, ``lmtrain.train(...)`` and ``lmtrain.finetune(...)`` are the Python API of `lmtrain
prepare`, `lmtrain train` and `lmtrain finetune` (imported on first use, so that ``import lmtrain`` and `lmtrain
--help` stay fast). The 4 x 4 RTX 3090 cluster kit
lives in tools/cluster-3090/ of the repository.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmtrain.version import __version__

if TYPE_CHECKING:
    from lmtrain.finetune_run import finetune
    from lmtrain.prepare_data import prepare
    from lmtrain.train_run import RunSummary, train

__all__ = ["RunSummary", "__version__", "finetune", "prepare", "train"]
_LAZY = {"prepare": "lmtrain.prepare_data", "train": "lmtrain.train_run", "RunSummary": "lmtrain.train_run",
         "finetune": "lmtrain.finetune_run"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmtrain' has no attribute {name!r}")
