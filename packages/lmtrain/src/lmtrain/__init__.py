"""The integration app: prepare, train, evaluate, generate and preflight checks for an ALiBi LM on a 4x4 RTX 3090 cluster."""

from lmtrain.version import __version__

__all__ = ["__version__"]
