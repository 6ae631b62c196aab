"""A raw-PyTorch training loop on DeepSpeed ZeRO-2 or plain torch: per-group clipping, schedules, atomic checkpoints, exact resume."""

from trainloop.version import __version__

__all__ = ["__version__"]
