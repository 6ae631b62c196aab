"""Byte layout of a tokbin token file: a 128-byte header, the token ids, then the document offsets.

See docs/token-file-format.md for the full description. Everything is little-endian.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"\x93TOKBIN\x00"
VERSION = 1
HEADER_SIZE = 128
# magic, version, header size, itemsize, flags, vocab, n_tokens, n_docs, eos, tokenizer sha256, data sha256,
# header crc32, reserved
_HEADER = struct.Struct("<8sIIIIQQQq32s32sII")
assert _HEADER.size == HEADER_SIZE  # a layout edit that changes the size must fail at import, not corrupt files
_CRC_SPAN = HEADER_SIZE - 8  # the crc covers everything before itself
OFFSET_DTYPE = np.dtype("<u8")
NO_TOKENIZER = b"\x00" * 32
# uint16 holds ids 0..65535, so a vocabulary of exactly 65536 still fits
UINT16_MAX_VOCAB = 1 << 16
UINT32_MAX_VOCAB = 1 << 32


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below ``vocab_size`` (uint16 or uint32).

    Example:
        >>> dtype_for_vocab(32000), dtype_for_vocab(65536), dtype_for_vocab(65537)
        (dtype('uint16'), dtype('uint16'), dtype('uint32'))
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= UINT16_MAX_VOCAB:
        return np.dtype("<u2")
    if vocab_size <= UINT32_MAX_VOCAB:
        return np.dtype("<u4")
    raise ValueError(f"vocab_size must be <= 2**32 for uint32 token files, got {vocab_size}")


def offsets_start(n_tokens: int, itemsize: int) -> int:
    """Byte position of the document offsets: after the tokens, rounded up to 8 so the uint64 memmap is aligned."""
    end = HEADER_SIZE + n_tokens * itemsize
    return (end + 7) // 8 * 8


def expected_size(n_tokens: int, n_docs: int, itemsize: int) -> int:
    """Exact size in bytes of a well-formed file with these counts."""
    return offsets_start(n_tokens, itemsize) + (n_docs + 1) * OFFSET_DTYPE.itemsize


def new_data_hash() -> hashlib._Hash:
    """The data checksum: SHA-256 over the token bytes, then the offset bytes (about 1.8 GB/s with SHA-NI)."""
    return hashlib.sha256()


@dataclass(frozen=True)
class Header:
    """The decoded 128-byte header of a token file."""

    version: int
    itemsize: int
    vocab_size: int
    n_tokens: int
    n_docs: int
    eos_id: int | None
    tokenizer_sha256: str | None
    data_sha256: str

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.itemsize == 2 else np.dtype("<u4")

    def pack(self) -> bytes:
        tok = bytes.fromhex(self.tokenizer_sha256) if self.tokenizer_sha256 else NO_TOKENIZER
        eos = -1 if self.eos_id is None else self.eos_id
        body = _HEADER.pack(
            MAGIC,
            self.version,
            HEADER_SIZE,
            self.itemsize,
            0,
            self.vocab_size,
            self.n_tokens,
            self.n_docs,
            eos,
            tok,
            bytes.fromhex(self.data_sha256),
            0,
            0,
        )
        crc = zlib.crc32(body[:_CRC_SPAN])
        return body[:_CRC_SPAN] + struct.pack("<II", crc, 0)


def unpack_header(raw: bytes, path: object) -> Header:
    """Decode and validate a header; raises TokenFileError naming ``path`` for anything foreign or damaged."""
    from tokbin.errors import TokenFileError

    if len(raw) < len(MAGIC) or raw[: len(MAGIC)] != MAGIC:
        found = raw[: len(MAGIC)]
        raise TokenFileError(path, f"not a tokbin file: expected magic {MAGIC!r}, found {found!r}")
    if len(raw) < HEADER_SIZE:
        raise TokenFileError(path, f"truncated: a header needs {HEADER_SIZE} bytes, file has {len(raw)}")
    (_, version, header_size, itemsize, _flags, vocab, n_tokens, n_docs, eos, tok, data, crc, _) = _HEADER.unpack(
        raw[:HEADER_SIZE]
    )
    if version != VERSION:
        raise TokenFileError(path, f"unknown format version: expected {VERSION}, found {version}")
    if zlib.crc32(raw[:_CRC_SPAN]) != crc:
        raise TokenFileError(path, f"header checksum mismatch: expected crc32 {crc:#010x}, header is damaged")
    if header_size != HEADER_SIZE:
        raise TokenFileError(path, f"bad header size: expected {HEADER_SIZE}, found {header_size}")
    if itemsize not in (2, 4):
        raise TokenFileError(path, f"bad token itemsize: expected 2 (uint16) or 4 (uint32), found {itemsize}")
    return Header(
        version=version,
        itemsize=itemsize,
        vocab_size=vocab,
        n_tokens=n_tokens,
        n_docs=n_docs,
        eos_id=None if eos < 0 else eos,
        tokenizer_sha256=None if tok == NO_TOKENIZER else tok.hex(),
        data_sha256=data.hex(),
    )
