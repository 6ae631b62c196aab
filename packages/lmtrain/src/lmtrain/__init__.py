"""The integration app: prepare, train, evaluate, generate, preflight checks and a demo for ALiBi GPT models.

The 4 x 4 RTX 3090 cluster kit lives in tools/cluster-3090/ of the repository.
"""

from lmtrain.version import __version__

__all__ = ["__version__"]
