"""A weighted mixture of token datasets read as one (``Blend``), and the JSON spec file that names one.

A blend is a virtual concatenation of its sources: source ``i`` occupies positions ``[offsets[i], offsets[i+1])``.
``BlendWindows`` (in ``tokbin.samplers``) draws each row's source by weight and a window start inside that source,
so no window crosses from one source into the next, and ``Loader`` reads a blend as it reads a ``TokenFile``.

A spec file is JSON; each path is relative to the spec file's directory and must stay inside it::

    {"sources": [{"path": "web.bin", "weight": 0.7},
                 {"path": "books.bin", "weight": 0.2},
                 {"path": "code.bin", "weight": 0.1}]}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokbin.errors import TokenFileError
from tokbin.samplers import BlendWindows, blend_probabilities
from tokbin.tokenfile import TokenFile, gather_windows

if TYPE_CHECKING:
    import torch

    from tokbin.text_tokenizer import Tokenizer

SPEC_KEYS = ("sources",)
SOURCE_KEYS = ("path", "weight")
# header fields every source must share: ids mean the same tokens only under one tokenizer
_SHARED_FIELDS = ("tokenizer_sha256", "vocab_size")


class Blend:
    """Sources with the TokenFile reading interface, weighted, read as one dataset.

    ``sources`` are TokenFiles (or anything with ``n_tokens``, ``n_docs``, ``vocab_size``, ``eos_id``,
    ``tokenizer_sha256``, ``dtype``, ``path`` and ``read_windows``, such as another Blend); they must share the
    tokenizer identity and the vocabulary size recorded in their headers, and their EOS ids where set. ``weights``
    are relative (any non-negative numbers, not all zero). ``gather_many`` refuses windows that cross a source's
    end; ``sampler()`` gives the matching ``BlendWindows``. Errors name ``spec_path`` and the source's field when
    one is given.

    Example::

        blend = Blend.from_spec("data/mix.json")  # or Blend([TokenFile("web.bin"), ...], [0.7, 0.2, 0.1])
        with Loader(blend, blend.sampler(seq_len=1024, batch_size=16, seed=0)) as loader:
            x, y = next(loader)  # (16, 1024) int64 each; every row from one source, chosen by weight
    """

    def __init__(
        self, sources: Sequence[TokenFile], weights: Sequence[float], *, spec_path: str | os.PathLike | None = None
    ) -> None:
        self.path = None if spec_path is None else Path(spec_path)
        if not sources or len(weights) != len(sources):
            raise ValueError(f"Blend needs one weight per source, got {len(sources)} sources, {len(weights)} weights")
        self.sources = list(sources)
        self.weights = tuple(float(w) for w in weights)
        self.probabilities = blend_probabilities(self.weights)
        first = self.sources[0]
        for i, source in enumerate(self.sources[1:], 1):
            for field in _SHARED_FIELDS:
                mine, theirs = getattr(source, field), getattr(first, field)
                if mine != theirs:
                    raise self._error(
                        i,
                        f"{field} is {_shown(mine)}, {self._name(0)} has {_shown(theirs)}: "
                        "a blend's sources must be encoded with one tokenizer",
                    )
        eos = {s.eos_id for s in self.sources} - {None}
        if len(eos) > 1:
            raise self._error(None, f"sources record different EOS ids {sorted(eos)}: expected one tokenizer's EOS")
        self.eos_id = eos.pop() if eos else None
        self.sizes = tuple(int(s.n_tokens) for s in self.sources)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)  # (n_sources + 1,)

    @classmethod
    def from_spec(cls, path: str | os.PathLike) -> Blend:
        """Open the blend a JSON spec file names (see the module docstring); TokenFileError for any bad entry."""
        spec_path = Path(path)
        entries = _read_spec(spec_path)
        sources = [TokenFile(spec_path.parent / entry["path"]) for entry in entries]
        return cls(sources, [entry["weight"] for entry in entries], spec_path=spec_path)

    vocab_size = property(lambda self: self.sources[0].vocab_size)
    tokenizer_sha256 = property(lambda self: self.sources[0].tokenizer_sha256)
    dtype = property(lambda self: self.sources[0].dtype)
    n_tokens = property(lambda self: int(self.offsets[-1]))
    n_docs = property(lambda self: sum(int(s.n_docs) for s in self.sources))

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        parts = ", ".join(f"{self._name(i)}: {w:g}" for i, w in enumerate(self.weights))
        return f"Blend({parts}; n_tokens={self.n_tokens}, vocab_size={self.vocab_size})"

    def _name(self, i: int) -> str:
        path = getattr(self.sources[i], "path", None)
        return f"sources[{i}] ({path})" if self.path is not None else str(path if path is not None else f"source {i}")

    def _error(self, i: int | None, message: str) -> TokenFileError:
        if self.path is not None:
            return TokenFileError(self.path, f"{self._name(i)}: {message}" if i is not None else message)
        return TokenFileError(self._name(i) if i is not None else "Blend", message)

    def info(self) -> dict:
        """Counts, identities and the sources with their weights, as a JSON-able dict."""
        return {
            "path": None if self.path is None else str(self.path),
            "vocab_size": self.vocab_size,
            "n_tokens": self.n_tokens,
            "n_docs": self.n_docs,
            "eos_id": self.eos_id,
            "tokenizer_sha256": self.tokenizer_sha256,
            "sources": [
                {"path": str(getattr(s, "path", "")), "weight": w, "probability": float(p), "n_tokens": n}
                for s, w, p, n in zip(self.sources, self.weights, self.probabilities, self.sizes, strict=True)
            ],
        }

    def sampler(self, seq_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1) -> BlendWindows:
        """The ``BlendWindows`` sampler over this blend's source sizes and weights."""
        return BlendWindows(self.sizes, self.weights, seq_len, batch_size, seed=seed, rank=rank, world_size=world_size)

    def gather(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for windows at blend positions ``starts``, as ``TokenFile.gather``."""
        return self.gather_many([starts], seq_len)[0]

    def gather_many(
        self, starts_list: Sequence[np.ndarray], seq_len: int, *, pin_memory: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``TokenFile.gather_many`` over the blend; a window that does not lie inside one source is an IndexError.

        Example: ``[(x0, y0), (x1, y1)] = blend.gather_many([starts0, starts1], 1024)``
        """
        return gather_windows(self.read_windows, starts_list, seq_len, pin_memory)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``TokenFile.read_windows`` over the blend: each source reads its rows in one call, into one array.

        Example: ``blend.read_windows(np.array([0, blend.offsets[1]]), 1025)  # a row from each of two sources``
        """
        starts = np.asarray(starts, dtype=np.int64)
        if starts.ndim != 1 or length < 1:
            raise ValueError(f"read_windows: expected 1-D starts and length >= 1, got shape {starts.shape}, {length}")
        source = np.clip(np.searchsorted(self.offsets, starts, side="right") - 1, 0, len(self.sources) - 1)
        outside = (starts < 0) | (starts + length > self.offsets[source + 1])
        if outside.any():
            bad = int(np.flatnonzero(outside)[0])
            s, lo, hi = int(source[bad]), int(self.offsets[source[bad]]), int(self.offsets[source[bad] + 1])
            raise IndexError(
                f"gather: the window of {length} tokens at {int(starts[bad])} is not inside one source "
                f"(source {s}, {getattr(self.sources[s], 'path', '')}, holds [{lo}, {hi})): blend windows stay "
                "inside one source"
            )
        present = np.unique(source)
        if present.size == 1:
            return self.sources[present[0]].read_windows(starts - self.offsets[present[0]], length)
        rows = np.empty((starts.size, length), dtype=self.dtype)
        for s in present:
            mine = np.flatnonzero(source == s)
            rows[mine] = self.sources[s].read_windows(starts[mine] - self.offsets[s], length)
        return rows

    def verify(self, tokenizer: str | os.PathLike | Tokenizer | None = None, *, progress: bool = False) -> dict:
        """``TokenFile.verify`` for every source (checksums, ids, document index, tokenizer identity)."""
        from tokbin.text_tokenizer import load_tokenizer

        tok = None if tokenizer is None else load_tokenizer(tokenizer)  # read once, not once per source
        reports = [s.verify(tok, progress=progress) for s in self.sources]
        return {
            "path": None if self.path is None else str(self.path),
            "n_tokens": self.n_tokens,
            "max_id": max(r["max_id"] for r in reports),
            "sources": reports,
        }


def _shown(value: object) -> str:
    return "none recorded" if value is None else repr(value)


def _read_spec(spec_path: Path) -> list[dict]:
    """The spec's source entries, each checked: a relative path to a file inside the spec's directory, a weight."""

    def fail(message: str) -> TokenFileError:
        return TokenFileError(spec_path, message)

    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise fail("no such file: expected a blend spec (JSON)") from None
    except IsADirectoryError:
        raise fail("is a directory: expected a blend spec file (JSON)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"unreadable blend spec: expected JSON, found {e}") from None
    example = '{"sources": [{"path": "web.bin", "weight": 0.7}, ...]}'
    if not isinstance(spec, dict):
        raise fail(f"expected a JSON object such as {example}, found {type(spec).__name__}")
    for key in spec:
        if key not in SPEC_KEYS:
            raise fail(f"unknown key {key!r}: expected only {list(SPEC_KEYS)}, as in {example}")
    entries = spec.get("sources")
    if not isinstance(entries, list) or not entries:
        raise fail(f"sources: expected a non-empty list of {{'path', 'weight'}} objects, as in {example}")
    directory = spec_path.parent
    inside = directory.resolve()
    for i, entry in enumerate(entries):
        where = f"sources[{i}]"
        if not isinstance(entry, dict):
            raise fail(f"{where}: expected an object with 'path' and 'weight', found {type(entry).__name__}")
        for key in entry:
            if key not in SOURCE_KEYS:
                raise fail(f"{where}: unknown key {key!r}: expected only {list(SOURCE_KEYS)}")
        for key in SOURCE_KEYS:
            if key not in entry:
                raise fail(f"{where}.{key}: missing: every source needs {list(SOURCE_KEYS)}")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise fail(f"{where}.weight: expected a finite number >= 0, found {weight!r}")
        name = entry["path"]
        if not isinstance(name, str) or not name:
            raise fail(f"{where}.path: expected a file name relative to {directory}, found {name!r}")
        relative = Path(name)
        if relative.is_absolute():
            raise fail(f"{where}.path: {name!r} is absolute: expected a path relative to the spec's directory")
        if ".." in relative.parts:
            raise fail(f"{where}.path: {name!r} contains '..': expected a path that stays inside {directory}")
        target = directory / relative
        if not target.resolve().is_relative_to(inside):
            raise fail(f"{where}.path: {name!r} resolves outside {directory}: expected a file inside it")
        if not target.is_file():
            raise fail(f"{where}.path: no such file {str(target)!r}: expected a token file relative to {directory}")
    if sum(entry["weight"] for entry in entries) <= 0:
        raise fail("sources: the weights sum to 0: expected at least one weight > 0")
    return entries
