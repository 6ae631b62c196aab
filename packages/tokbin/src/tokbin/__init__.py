"""SentencePiece tokenization into a self-describing binary token file, memmap batches, samplers and prefetch."""

from tokbin.cleaning import clean_text
from tokbin.encode import encode_files
from tokbin.errors import TokenFileError
from tokbin.loader import ClosableBackgroundGenerator, Loader
from tokbin.samplers import DocumentLengths, DynamicLength, EpochWindows, RandomWindows, SeqLenWarmup
from tokbin.sft import IGNORE_INDEX, sft_example
from tokbin.tokenfile import BLOCK_TOKENS, TokenFile
from tokbin.tokenizer import file_sha256, train_tokenizer
from tokbin.version import __version__
from tokbin.writer import write_tokens

__all__ = [
    "BLOCK_TOKENS",
    "IGNORE_INDEX",
    "ClosableBackgroundGenerator",
    "DocumentLengths",
    "DynamicLength",
    "EpochWindows",
    "Loader",
    "RandomWindows",
    "SeqLenWarmup",
    "TokenFile",
    "TokenFileError",
    "__version__",
    "clean_text",
    "encode_files",
    "file_sha256",
    "sft_example",
    "train_tokenizer",
    "write_tokens",
]
