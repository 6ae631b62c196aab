"""A directory of token-file shards with one ``manifest.json``, read as one dataset (``ShardedTokens``).

The manifest lists the shards in order with their token and document counts and data checksums, the tokenizer's
SHA-256, and what the encode that wrote them read (inputs and options), so that an interrupted encode resumes
after its last finished shard. A manifest whose ``complete`` is false belongs to an encode still running or
interrupted: readers refuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokbin.errors import TokenFileError
from tokbin.tokenfile import TokenFile, gather_windows
from tokbin.writer import atomic_output

if TYPE_CHECKING:
    import torch

    from tokbin.text_tokenizer import Tokenizer

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "tokbin-shards"
MANIFEST_VERSION = 1


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` as a dict; TokenFileError for a missing, foreign or damaged one."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenFileError(path, "no such file: expected the manifest of a tokbin shard directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenFileError(path, f"unreadable manifest: expected JSON, found {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise TokenFileError(path, f'not a tokbin manifest: expected "format": "{MANIFEST_FORMAT}"')
    if manifest.get("version") != MANIFEST_VERSION:
        found = manifest.get("version")
        raise TokenFileError(path, f"unknown manifest version: expected {MANIFEST_VERSION}, found {found}")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("file"), str) for s in shards):
        raise TokenFileError(path, 'bad manifest: expected "shards" to be a list of {"file": ...} entries')
    for s in shards:
        name = s["file"]
        if Path(name).name != name or name.startswith("."):
            raise TokenFileError(path, f"shard {name!r}: expected a file name inside {directory}, found a path")
    return manifest


def _check_listing(where: Path, manifest: dict[str, Any]) -> None:
    """A complete manifest lists every shard of its encode: totals present, shards numbered 0, 1, ... in order, the
    last one ending at the end of the last input (a manifest edited to list fewer shards is refused, not read as a
    smaller dataset)."""
    for key in ("n_tokens", "n_docs"):
        value = manifest.get(key)
        if type(value) is not int or value < 0:
            raise TokenFileError(where, f"{key}: expected the total as an int >= 0, found {value!r}")
    for i, entry in enumerate(manifest["shards"]):
        if entry["file"] != shard_name(i):
            expected = f"expected {shard_name(i)!r} (shards listed in order, none left out)"
            raise TokenFileError(where, f"shards[{i}] is {entry['file']!r}: {expected}")
    inputs = (manifest.get("encode") or {}).get("inputs")
    end = manifest["shards"][-1].get("end")
    if isinstance(inputs, list) and end != [len(inputs), 0, 1]:
        raise TokenFileError(
            where,
            f"the last shard listed ends at {end}, not at the end of the {len(inputs)} inputs: expected every shard "
            "the encode wrote listed; encode again to rebuild the directory",
        )


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically (the caller holds the directory's lock)."""
    with atomic_output(directory / MANIFEST, lock=False) as f:
        f.write((json.dumps(manifest, indent=1) + "\n").encode("utf-8"))


class ShardedTokens:
    """The shards of a directory written by ``encode_files(..., shard_bytes=...)``, read as one token sequence.

    Same reading interface as ``TokenFile``: ``n_tokens``, ``n_docs``, ``vocab_size``, ``eos_id``, ``dtype``,
    ``tokenizer_sha256``, ``doc_offsets``, ``document(i)``, ``gather``, ``gather_many``, ``verify``, ``info``.
    Windows may span shards. Opening checks each shard's header against the manifest; ``verify()`` checks the data.

    Example::

        ds = ShardedTokens("train_shards/")
        x, y = ds.gather(np.array([0, 4096]), 1024)  # two (1024,) int64 rows, y shifted by one
    """

    def __init__(self, path: str | os.PathLike) -> None:
        p = Path(path)
        self.path = p if p.is_dir() or p.name != MANIFEST else p.parent
        manifest = read_manifest(self.path)
        where = self.path / MANIFEST
        if manifest.get("complete") is not True:
            done = len(manifest["shards"])
            raise TokenFileError(where, f"incomplete encode ({done} shards so far): rerun the encode to finish it")
        if not manifest["shards"]:
            raise TokenFileError(where, "no shards: expected at least one")
        _check_listing(where, manifest)
        self.manifest = manifest
        self.shards: list[TokenFile] = []
        for entry in manifest["shards"]:
            tf = TokenFile(self.path / entry["file"])
            for key, want in [(k, entry.get(k)) for k in ("n_tokens", "n_docs", "data_sha256")] + [
                (k, manifest.get(k)) for k in ("vocab_size", "eos_id", "tokenizer_sha256")
            ]:
                if getattr(tf, key) != want:
                    raise TokenFileError(tf.path, f"{key}: the manifest says {want}, the shard has {getattr(tf, key)}")
            self.shards.append(tf)
        sizes = [tf.n_tokens for tf in self.shards]
        for key, found in (("n_tokens", sum(sizes)), ("n_docs", sum(tf.n_docs for tf in self.shards))):
            if found != manifest[key]:
                raise TokenFileError(
                    where,
                    f"{key}: the manifest says {manifest[key]}, its {len(self.shards)} shards hold {found}: expected "
                    "every shard the encode wrote listed; encode again to rebuild the directory",
                )
        # shard i holds the global positions [_starts[i], _starts[i + 1])
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._doc_starts = np.concatenate([[0], np.cumsum([tf.n_docs for tf in self.shards], dtype=np.int64)])
        self._doc_offsets: np.ndarray | None = None

    vocab_size = property(lambda self: self.manifest["vocab_size"])
    eos_id = property(lambda self: self.manifest["eos_id"])
    tokenizer_sha256 = property(lambda self: self.manifest["tokenizer_sha256"])
    dtype = property(lambda self: self.shards[0].dtype)
    n_tokens = property(lambda self: int(self._starts[-1]))
    n_docs = property(lambda self: int(self._doc_starts[-1]))

    @property
    def data_sha256(self) -> str:
        """SHA-256 over the shards' data checksums in order: one identity for the whole dataset."""
        return hashlib.sha256("".join(tf.data_sha256 for tf in self.shards).encode()).hexdigest()

    @property
    def doc_offsets(self) -> np.ndarray:
        """``n_docs + 1`` uint64 positions, as ``TokenFile.doc_offsets`` (built on first use: 8 bytes a document)."""
        if self._doc_offsets is None:
            pairs = zip(self.shards, self._starts[:-1], strict=True)
            parts = [np.asarray(tf.doc_offsets[:-1]) + np.uint64(s) for tf, s in pairs]
            self._doc_offsets = np.concatenate([*parts, np.array([self.n_tokens], dtype=np.uint64)])
        return self._doc_offsets

    def __reduce__(self):
        return (ShardedTokens, (str(self.path),))

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (
            f"ShardedTokens({str(self.path)!r}, shards={len(self.shards)}, n_tokens={self.n_tokens}, "
            f"n_docs={self.n_docs}, vocab_size={self.vocab_size}, dtype={self.dtype.name})"
        )

    def info(self) -> dict:
        """Counts and identities as a JSON-able dict (what ``tokbin info --json`` prints for a directory)."""
        return {
            "path": str(self.path),
            "shards": len(self.shards),
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "n_tokens": self.n_tokens,
            "n_docs": self.n_docs,
            "eos_id": self.eos_id,
            "tokenizer_sha256": self.tokenizer_sha256,
            "data_sha256": self.data_sha256,
            "file_bytes": sum(tf.path.stat().st_size for tf in self.shards),
        }

    def document(self, i: int) -> np.ndarray:
        """Ids of document ``i`` (a view into its shard: documents never span shards)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document index {i} out of range for {self.n_docs} documents in {self.path}")
        s = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        return self.shards[s].document(i - int(self._doc_starts[s]))

    def _span(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from global position ``start``, copied across shard ends."""
        out = np.empty(length, dtype=self.dtype)
        s, done = int(np.searchsorted(self._starts, start, side="right")) - 1, 0
        while done < length:
            local = start + done - int(self._starts[s])
            take = min(length - done, self.shards[s].n_tokens - local)
            out[done : done + take] = self.shards[s].tokens[local : local + take]
            done, s = done + take, s + 1
        return out

    def gather(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for windows at ``starts``: two (B, seq_len) int64 tensors, as ``TokenFile.gather``."""
        return self.gather_many([starts], seq_len)[0]

    def gather_many(
        self, starts_list: Sequence[np.ndarray], seq_len: int, *, pin_memory: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``TokenFile.gather_many`` over the shards (windows may cross a shard's end).

        Example: ``[(x0, y0), (x1, y1)] = ds.gather_many([starts0, starts1], 1024)``
        """
        return gather_windows(self.read_windows, starts_list, seq_len, pin_memory)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``TokenFile.read_windows`` over the shards: the rows inside one shard in one read of that shard, the few
        that cross a shard's end copied piecewise.

        Example: ``ds.read_windows(np.array([0, 4096]), 1025)  # (2, 1025) in the file dtype``
        """
        starts = np.asarray(starts, dtype=np.int64)
        if starts.ndim != 1 or length < 1:
            raise ValueError(f"read_windows: expected 1-D starts and length >= 1, got shape {starts.shape}, {length}")
        lo, hi = (int(starts.min()), int(starts.max())) if starts.size else (0, 0)
        if lo < 0 or hi + length > self.n_tokens:
            raise IndexError(
                f"gather: windows of {length} tokens at starts {lo}..{hi} "
                f"exceed the {self.n_tokens} tokens of {self.path}"
            )
        rows = np.empty((starts.size, length), dtype=self.dtype)
        shard_of = np.searchsorted(self._starts, starts, side="right") - 1
        local = starts - self._starts[shard_of]
        for s in np.unique(shard_of):
            sel = np.flatnonzero(shard_of == s)
            inside = local[sel] + length <= self.shards[s].n_tokens
            if inside.any():
                rows[sel[inside]] = self.shards[s].read_windows(local[sel[inside]], length)
            for r in sel[~inside]:
                rows[r] = self._span(int(starts[r]), length)
        return rows

    def verify(self, tokenizer: str | os.PathLike | Tokenizer | None = None, *, progress: bool = False) -> dict:
        """``TokenFile.verify`` for every shard (checksums, ids, document index, tokenizer identity)."""
        from tokbin.text_tokenizer import load_tokenizer

        tok = None if tokenizer is None else load_tokenizer(tokenizer)  # read once, not once per shard
        max_id = -1
        for tf in self.shards:
            max_id = max(max_id, tf.verify(tok, progress=progress)["max_id"])
        return {"path": str(self.path), "n_tokens": self.n_tokens, "max_id": max_id, "data_sha256": self.data_sha256}


def open_tokens(path: str | os.PathLike) -> TokenFile | ShardedTokens:
    """A token file, or a shard directory (or its manifest.json) as ``ShardedTokens``.

    Example: ``ds = open_tokens("data/train")  # TokenFile or ShardedTokens, same reading interface``
    """
    p = Path(path)
    if p.is_dir() or p.name == MANIFEST:
        return ShardedTokens(p)
    return TokenFile(p)
