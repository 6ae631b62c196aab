"""A SentencePiece model behind the :class:`tokbin.text_tokenizer.Tokenizer` interface.

Text is encoded line by line with the newlines kept, the unit ``tokbin encode`` has always used for SentencePiece
(a document's ids are the same here and in a token file): with the lossless options (``"\\n"`` a user-defined
symbol, identity normalisation, no dummy prefix) they equal encoding the whole text. Nothing about SentencePiece's
own behaviour changes: the processor is used as it is (``.processor``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from tokbin.errors import TokenFileError
from tokbin.text_tokenizer import TemplateSource
from tokbin.tokenizer import _fields, _varint, file_sha256, load_processor

# ModelProto.pieces (1) -> SentencePiece {piece (1), type (3)}; type CONTROL = 3, USER_DEFINED = 4 (NORMAL if absent)
_PIECES, _PIECE, _TYPE = 1, 1, 3
_CONTROL, _USER_DEFINED = 3, 4


def _matched_whole(model: bytes) -> dict[int, str]:
    """Control and user-defined pieces of a serialized model, by id (the pieces SentencePiece never splits)."""
    out: dict[int, str] = {}
    index = 0
    for number, _, payload in _fields(model):
        if number != _PIECES:
            continue
        piece, kind = "", 1
        for field, raw, value in _fields(payload):
            if field == _PIECE:
                piece = value.decode("utf-8")
            elif field == _TYPE:
                kind = raw[-1]  # a one-byte varint after a one-byte key
        if kind in (_CONTROL, _USER_DEFINED):
            out[index] = piece
        index += 1
    return out


def _pieces(text_proto: bytes) -> list[tuple[int, int, int]]:
    """(id, begin byte, end byte) of each piece of a serialized SentencePieceText (sentencepiece.proto: pieces = 2,
    and in each piece id = 2, begin = 4, end = 5), read without the protobuf package."""
    out = []
    for number, _, payload in _fields(text_proto):
        if number == 2:
            values = {field: _varint(raw, 1)[0] for field, raw, _ in _fields(payload) if field in (2, 4, 5)}
            out.append((values.get(2, 0), values.get(4, 0), values.get(5, 0)))
    return out


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


class SentencePieceTokenizer:
    """A ``sentencepiece.SentencePieceProcessor`` as a :class:`~tokbin.text_tokenizer.Tokenizer`.

    ``sha256`` is the SHA-256 of the ``.model`` file (for an in-memory processor: of its serialized model, the same
    bytes for a model SentencePiece or ``train_tokenizer`` wrote). ``special_ids`` and ``added_tokens`` are the
    control pieces (``<s>``, ``</s>``) and user-defined symbols (``<|end|>``, ``"\\n"``...). A SentencePiece model has
    no chat template: ``chat_template`` is None unless given.

    Example::

        tok = SentencePieceTokenizer.load("out/spm.model")
        ids = tok.encode("to be\\nor not")  # == sp.encode("to be\\n") + sp.encode("or not")
        tok.decode(ids), tok.eos_id, tok.special_tokens["eos_token"]  # ('to be\\nor not', 2, '</s>')
    """

    kind = "sentencepiece"

    def __init__(
        self,
        processor: spm.SentencePieceProcessor,
        *,
        path: str | os.PathLike | None = None,
        sha256: str | None = None,
        chat_template: TemplateSource | None = None,
    ) -> None:
        self.processor = processor
        self.path = None if path is None else Path(path)
        model = processor.serialized_model_proto()
        self.sha256 = sha256 or hashlib.sha256(model).hexdigest()
        self.vocab_size = int(processor.get_piece_size())
        ids = {"bos": processor.bos_id(), "eos": processor.eos_id(), "pad": processor.pad_id()}
        ids["unk"] = processor.unk_id()
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            int(ids[k]) if ids[k] >= 0 else None for k in ("bos", "eos", "pad", "unk")
        )
        self.special_tokens = {
            f"{role}_token": processor.id_to_piece(i)
            for role, i in (("bos", self.bos_id), ("eos", self.eos_id), ("unk", self.unk_id), ("pad", self.pad_id))
            if i is not None
        }
        self.added_tokens = _matched_whole(model)
        self.special_ids = frozenset(self.added_tokens)
        self.chat_template = chat_template

    @classmethod
    def load(cls, path: str | os.PathLike, *, chat_template: TemplateSource | None = None) -> SentencePieceTokenizer:
        """Open a ``.model`` file (one TokenFileError line if it is missing or not a SentencePiece model)."""
        return cls(load_processor(path), path=path, sha256=file_sha256(path), chat_template=chat_template)

    def __reduce__(self):
        # worker processes get the serialized model, not a path that might have changed since
        state = (self.processor.serialized_model_proto(), self.path, self.sha256, self.chat_template)
        return (_rebuild, state)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path or '<in memory>'}, vocab_size={self.vocab_size})"

    # ---- encoding ----------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``, line by line with the newlines kept; BOS first if ``add_special_tokens`` and it has one."""
        ids = [i for line in self.processor.encode(_lines(text), out_type=int) for i in line]
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` of each text, in one SentencePiece call."""
        lines = [_lines(t) for t in texts]
        flat = self.processor.encode([line for ls in lines for line in ls], out_type=int)
        out, k = [], 0
        for ls in lines:
            ids = [i for line in flat[k : k + len(ls)] for i in line]
            out.append(self._with_bos(ids) if add_special_tokens else ids)
            k += len(ls)
        return out

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each id's (start, end) character span in ``text``."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        base = 0
        for line in _lines(text):
            raw = line.encode("utf-8")
            char_at = [0] * (len(raw) + 1)  # byte offset -> character offset within the line
            pos = 0
            for c, ch in enumerate(line):
                n = len(ch.encode("utf-8"))
                for b in range(pos, pos + n):
                    char_at[b] = c
                pos += n
            char_at[len(raw)] = len(line)
            for piece_id, begin, end_byte in _pieces(self.processor.encode(line, out_type="serialized_proto")):
                ids.append(piece_id)
                start, end = char_at[begin], char_at[end_byte]
                if end == start and start < len(line):
                    end = start + 1  # a byte-fallback piece: part of the character that starts at its begin
                offsets.append((base + start, base + end))
            base += len(line)
        return ids, offsets

    def _with_bos(self, ids: list[int]) -> list[int]:
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids outside the vocabulary (a model's padded rows) are dropped, and special pieces too
        with ``skip_special_tokens`` (SentencePiece itself never writes control pieces)."""
        drop = self.special_ids if skip_special_tokens else frozenset()
        return self.processor.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) not in drop])

    def token_to_id(self, token: str) -> int | None:
        i = int(self.processor.piece_to_id(token))
        if i == self.unk_id and token != self.processor.id_to_piece(i):
            return None  # SentencePiece answers the unknown id for a piece it does not have
        return i

    def id_to_token(self, token_id: int) -> str | None:
        return self.processor.id_to_piece(int(token_id)) if 0 <= int(token_id) < self.vocab_size else None


def _rebuild(
    model: bytes, path: Path | None, sha256: str, chat_template: TemplateSource | None
) -> SentencePieceTokenizer:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model)
    except RuntimeError as e:  # not reachable from a model that loaded once; kept one line all the same
        raise TokenFileError(path or "<model>", f"not a SentencePiece model: {e}") from None
    return SentencePieceTokenizer(processor, path=path, sha256=sha256, chat_template=chat_template)
