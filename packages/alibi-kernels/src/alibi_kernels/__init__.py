"""Fused causal attention with ALiBi positions: Triton kernels (forward and backward) and a plain-PyTorch path."""

from alibi_kernels.version import __version__

__all__ = ["__version__"]
