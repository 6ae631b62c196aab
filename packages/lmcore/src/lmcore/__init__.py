"""A decoder-only language model with ALiBi: configs, presets, init schemes, LoRA, generation, memory estimates."""

from lmcore.config import PRESETS, ModelConfig, n_params
from lmcore.generation import generate
from lmcore.init_schemes import (
    INIT_FUNCTIONS,
    InitReport,
    init_gpt2,
    init_kaiming,
    init_report,
    init_small,
    init_xavier,
    initialize,
)
from lmcore.model import GPT, KVCache, LMOutput
from lmcore.version import __version__

__all__ = [
    "GPT",
    "INIT_FUNCTIONS",
    "PRESETS",
    "InitReport",
    "KVCache",
    "LMOutput",
    "ModelConfig",
    "__version__",
    "generate",
    "init_gpt2",
    "init_kaiming",
    "init_report",
    "init_small",
    "init_xavier",
    "initialize",
    "n_params",
]
