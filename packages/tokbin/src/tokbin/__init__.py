"""SentencePiece tokenization into a self-describing binary token file, memmap batches, samplers and prefetch."""

from tokbin.version import __version__

__all__ = ["__version__"]
