"""100 Hz GPU monitoring through NVML, as a library and as a command that replaces `watch nvidia-smi`."""

from gpumon.version import __version__

__all__ = ["__version__"]
