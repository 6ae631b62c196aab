"""The tokenizer interface tokbin and its users share, and ``load_tokenizer``, which opens either kind.

Two kinds implement :class:`Tokenizer`: :class:`tokbin.spm_tokenizer.SentencePieceTokenizer` (a SentencePiece
``.model``, as ``tokbin train-tokenizer`` writes) and :class:`tokbin.hf_tokenizer.HFTokenizer` (a Hugging Face
``tokenizer.json`` with its ``tokenizer_config.json`` and chat template, as a base model ships them; it needs the
``hf`` extra). Both encode without adding special tokens unless asked, report the same special-token roles, carry a
SHA-256 identity that token files record, and pickle as their serialized form, which is how the encoder's worker
processes receive them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokbin.errors import TokenFileError

# The special-token roles transformers passes to a chat template as variables (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TemplateSource:
    """A chat template's Jinja text and where it was read from: ``origin`` is the file, ``field`` the key inside it
    (``"chat_template"`` in tokenizer_config.json) or ``""`` for a file that holds only the template."""

    text: str
    origin: str = "<chat template>"
    field: str = "chat_template"

    @property
    def sha256(self) -> str:
        """SHA-256 of the template's UTF-8 text (a run can record it beside the tokenizer's identity)."""
        import hashlib

        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@runtime_checkable
class Tokenizer(Protocol):
    """What tokbin's encoder, its chat-template labelling and lmtrain need from a tokenizer.

    Ids never include special tokens the tokenizer would add on its own (BOS, say) unless
    ``add_special_tokens=True``, as transformers' ``apply_chat_template`` tokenizes; special tokens written in the
    text (``<|im_end|>``) are matched whole. ``encode_offsets`` gives each id's ``(start, end)`` character span in
    the text (several ids share a character that byte-level tokens split).
    """

    kind: str  # "sentencepiece" or "hf"
    path: Path | None  # the .model file or the Hugging Face directory (None for an in-memory SentencePiece model)
    sha256: str  # the identity a token file records (see each kind for what it covers)
    vocab_size: int  # every id is below it
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    special_tokens: dict[str, str]  # role ("bos_token", "eos_token", ...) -> token text: a chat template's variables
    added_tokens: dict[int, str]  # tokens matched whole in text: HF added tokens, SentencePiece control/user pieces
    special_ids: frozenset[int]  # ids of special tokens (what skip_special_tokens drops; end-of-turn candidates)
    chat_template: TemplateSource | None  # the tokenizer's own chat template, if it has one

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...


def _resolve(path: Path) -> tuple[str, Path]:
    """("hf", tokenizer.json) or ("sentencepiece", the .model file) for a path ``load_tokenizer`` accepts."""
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return "hf", path / "tokenizer.json"
        models = sorted(path.glob("*.model"))
        if len(models) == 1:
            return "sentencepiece", models[0]
        found = f"{len(models)} .model files" if models else "neither"
        raise TokenFileError(
            path,
            f"no tokenizer: expected tokenizer.json (a Hugging Face tokenizer) or one SentencePiece .model file, "
            f"found {found}; point at the model directory the base model came with, or at the .model file",
        )
    if path.name == "tokenizer.json" or path.suffix == ".json":
        if not path.is_file():
            raise TokenFileError(path, "no such file: expected a Hugging Face tokenizer.json")
        return "hf", path
    return "sentencepiece", path


def tokenizer_sha256(tokenizer: str | os.PathLike) -> str:
    """The identity ``load_tokenizer(tokenizer).sha256`` gives, without building the tokenizer: the SHA-256 of the
    ``.model`` file, or of a Hugging Face directory's ``tokenizer.json`` (what a run's tokenizer check compares).

    Example::

        tokenizer_sha256("Qwen2-0.5B/") == TokenFile("train.bin").tokenizer_sha256
    """
    from tokbin.tokenizer import file_sha256

    return file_sha256(_resolve(Path(tokenizer))[1])


def load_tokenizer(tokenizer: str | os.PathLike | Any) -> Tokenizer:
    """The tokenizer at ``tokenizer``: a SentencePiece ``.model`` file, a Hugging Face model directory (one holding
    ``tokenizer.json``; preferred where a directory also holds a ``.model``), a ``tokenizer.json`` file (its
    directory is read), a directory holding a single ``.model``; a :class:`Tokenizer` or a
    ``sentencepiece.SentencePieceProcessor`` passes through (the processor wrapped).

    Example::

        tok = load_tokenizer("Qwen2-0.5B/")  # HFTokenizer: tokenizer.json + tokenizer_config.json (+ template)
        tok = load_tokenizer("out/spm.model")  # SentencePieceTokenizer
        tok.encode("Hello"), tok.eos_id, tok.sha256
    """
    from tokbin.spm_tokenizer import SentencePieceTokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        kind, path = _resolve(Path(tokenizer))
        if kind == "hf":
            from tokbin.hf_tokenizer import HFTokenizer

            return HFTokenizer.load(path.parent, path)
        return SentencePieceTokenizer.load(path)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    import sentencepiece as spm

    if isinstance(tokenizer, spm.SentencePieceProcessor):
        return SentencePieceTokenizer(tokenizer)
    raise TypeError(f"tokenizer: expected a path, a Tokenizer or a SentencePieceProcessor, got {type(tokenizer)}")
