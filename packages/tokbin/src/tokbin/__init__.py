"""Tokenization (SentencePiece or Hugging Face) into a self-describing binary token file, memmap batches, samplers."""

from typing import TYPE_CHECKING

from tokbin.blend import Blend
from tokbin.cleaning import clean_text
from tokbin.documents import HashSplit
from tokbin.encode import EncodeResult, encode_files, encode_inputs
from tokbin.errors import TokenFileError
from tokbin.hf_tokenizer import HFTokenizer
from tokbin.samplers import BlendWindows, DocumentLengths, DynamicLength, EpochWindows, RandomWindows, SeqLenWarmup
from tokbin.shards import ShardedTokens, open_tokens
from tokbin.spm_tokenizer import SentencePieceTokenizer
from tokbin.text_tokenizer import TemplateSource, Tokenizer, load_tokenizer, tokenizer_sha256
from tokbin.tokenfile import BLOCK_TOKENS, TokenFile
from tokbin.tokenizer import file_sha256, train_tokenizer
from tokbin.version import __version__
from tokbin.writer import TokenWriter, write_tokens

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from tokbin.chat_encode import ChatEncoding, chat_prompt_ids, encode_chat, generation_prompt
    from tokbin.chat_template import ChatTemplate, ChatTemplateError
    from tokbin.loader import ClosableBackgroundGenerator, Loader
    from tokbin.sft import IGNORE_INDEX, sft_example

# torch- and jinja2-backed parts load on first access, so the CLI and file tools start without importing them
_LAZY = {
    "ChatEncoding": "tokbin.chat_encode",
    "ChatTemplate": "tokbin.chat_template",
    "ChatTemplateError": "tokbin.chat_template",
    "chat_prompt_ids": "tokbin.chat_encode",
    "encode_chat": "tokbin.chat_encode",
    "generation_prompt": "tokbin.chat_encode",
    "ClosableBackgroundGenerator": "tokbin.loader",
    "Loader": "tokbin.loader",
    "IGNORE_INDEX": "tokbin.sft",
    "sft_example": "tokbin.sft",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokbin' has no attribute {name!r}")


__all__ = [
    "BLOCK_TOKENS",
    "IGNORE_INDEX",
    "Blend",
    "BlendWindows",
    "ChatEncoding",
    "ChatTemplate",
    "ChatTemplateError",
    "ClosableBackgroundGenerator",
    "DocumentLengths",
    "DynamicLength",
    "EncodeResult",
    "EpochWindows",
    "HFTokenizer",
    "HashSplit",
    "Loader",
    "RandomWindows",
    "SentencePieceTokenizer",
    "SeqLenWarmup",
    "ShardedTokens",
    "TemplateSource",
    "TokenFile",
    "TokenFileError",
    "TokenWriter",
    "Tokenizer",
    "__version__",
    "chat_prompt_ids",
    "clean_text",
    "encode_chat",
    "encode_files",
    "encode_inputs",
    "file_sha256",
    "generation_prompt",
    "load_tokenizer",
    "open_tokens",
    "sft_example",
    "tokenizer_sha256",
    "train_tokenizer",
    "write_tokens",
]
