"""A decoder-only language model with ALiBi: configs and presets, initialisation schemes, LoRA, generation, memory estimates."""

from lmcore.version import __version__

__all__ = ["__version__"]
