"""Read-only access to a token file: memmapped ids, zero-copy windows and blocks, vectorised batch gather."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokbin.bar import Bar
from tokbin.errors import TokenFileError
from tokbin.fileformat import (
    HEADER_SIZE,
    OFFSET_DTYPE,
    Header,
    expected_size,
    new_data_hash,
    offsets_start,
    unpack_header,
)

if TYPE_CHECKING:
    import torch

    from tokbin.text_tokenizer import Tokenizer

BLOCK_TOKENS = 1 << 17
_VERIFY_CHUNK = 1 << 24  # tokens per verify step: large enough to amortise, small enough to bound memory


def _torch():
    # imported on first use so that `tokbin info/verify/encode` start without paying for `import torch`
    import torch

    return torch


def _zero_copy_tensor(arr: np.ndarray) -> torch.Tensor:
    # torch warns that the memmap is read-only; the tensor shares its memory and must not be written to
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _torch().from_numpy(arr)


def gather_windows(
    read_windows: Callable[[np.ndarray, int], np.ndarray],
    starts_list: Sequence[np.ndarray],
    seq_len: int,
    pin_memory: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``gather_many`` for any dataset from its ``read_windows(starts, length)``: one read of the ``(B, T+1)`` ids of
    every batch, then one widening copy into an int64 ``(2, B, T)`` buffer (page-locked with ``pin_memory``)
    whose row ranges are the batches' inputs and targets."""
    arrays = [np.asarray(st, dtype=np.int64) for st in starts_list]
    for st in arrays:
        if st.ndim != 1 or seq_len < 1:
            raise ValueError(f"gather: expected 1-D starts and seq_len >= 1, got shape {st.shape}, {seq_len}")
    starts = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    rows = read_windows(starts, seq_len + 1)  # (B, T+1) in the file dtype
    torch = _torch()
    if pin_memory:
        buffer = torch.empty((2, starts.size, seq_len), dtype=torch.int64, pin_memory=True)
        both = buffer.numpy()
    else:
        both = np.empty((2, starts.size, seq_len), dtype=np.int64)
    both[0] = rows[:, :-1]  # the widening copy writes straight into contiguous inputs and targets
    both[1] = rows[:, 1:]
    out, first = [], 0
    for st in arrays:
        last = first + st.size
        if pin_memory:  # views of the pinned tensor itself, so CUDA's host allocator tracks async copies from it
            out.append((buffer[0, first:last], buffer[1, first:last]))
        else:  # cut in numpy: a third of the cost of slicing a tensor (~2.5 us a view, a quarter of a gather)
            out.append((torch.from_numpy(both[0, first:last]), torch.from_numpy(both[1, first:last])))
        first = last
    return out


class TokenFile:
    """A token file opened read-only through ``np.memmap``.

    Attributes: ``vocab_size``, ``eos_id`` (None if unset), ``n_tokens``, ``n_docs``, ``dtype`` (uint16 or uint32),
    ``tokenizer_sha256`` (hex or None), ``data_sha256``, ``tokens`` (1-D memmap) and ``doc_offsets`` (uint64 memmap of
    ``n_docs + 1`` positions: document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i + 1]]``).
    Opening checks the magic, version, header checksum and the exact file size; ``verify()`` checks the data.

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> from tokbin import write_tokens
        >>> out = tempfile.TemporaryDirectory()
        >>> _ = write_tokens(f"{out.name}/train.bin", np.arange(100), vocab_size=1000)
        >>> tf = TokenFile(f"{out.name}/train.bin")
        >>> tf.n_tokens, tf.verify()["max_id"]  # verify() reads the whole file against its checksum
        (100, 99)
        >>> x, y = tf.gather(np.array([0, 40]), 4)  # two windows of 4 tokens as int64 rows; y is x shifted by one
        >>> x.tolist(), y.tolist()
        ([[0, 1, 2, 3], [40, 41, 42, 43]], [[1, 2, 3, 4], [41, 42, 43, 44]])
        >>> out.cleanup()
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
        except FileNotFoundError:
            raise TokenFileError(self.path, "no such file: expected a tokbin token file") from None
        except IsADirectoryError:
            raise TokenFileError(self.path, "is a directory: expected a tokbin token file") from None
        if size == 0:
            raise TokenFileError(self.path, "not a tokbin file: file is empty")
        self.header: Header = unpack_header(raw, self.path)
        h = self.header
        want = expected_size(h.n_tokens, h.n_docs, h.itemsize)
        if size != want:
            kind = "truncated" if size < want else "over-long"
            raise TokenFileError(
                self.path,
                f"{kind}: header says {h.n_tokens} tokens and {h.n_docs} documents ({want} bytes), "
                f"file has {size} bytes",
            )
        self.tokens = np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER_SIZE, shape=(h.n_tokens,))
        self.doc_offsets = np.memmap(
            self.path, dtype=OFFSET_DTYPE, mode="r", offset=offsets_start(h.n_tokens, h.itemsize), shape=(h.n_docs + 1,)
        )
        self._window_views: dict[int, np.ndarray] = {}
        if int(self.doc_offsets[-1]) != h.n_tokens:
            raise TokenFileError(
                self.path, f"bad document index: expected last offset {h.n_tokens}, found {int(self.doc_offsets[-1])}"
            )

    vocab_size = property(lambda self: self.header.vocab_size)
    eos_id = property(lambda self: self.header.eos_id)
    n_tokens = property(lambda self: self.header.n_tokens)
    n_docs = property(lambda self: self.header.n_docs)
    dtype = property(lambda self: self.header.dtype)
    tokenizer_sha256 = property(lambda self: self.header.tokenizer_sha256)
    data_sha256 = property(lambda self: self.header.data_sha256)

    def __reduce__(self):
        # pickling an np.memmap would copy every token; a worker process reopens the file by path instead
        return (TokenFile, (str(self.path),))

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, n_tokens={self.n_tokens}, n_docs={self.n_docs}, "
            f"vocab_size={self.vocab_size}, dtype={self.dtype.name})"
        )

    def info(self) -> dict:
        """The header and counts as a JSON-able dict (what ``tokbin info --json`` prints)."""
        h = self.header
        return {
            "path": str(self.path),
            "format_version": h.version,
            "dtype": h.dtype.name,
            "vocab_size": h.vocab_size,
            "n_tokens": h.n_tokens,
            "n_docs": h.n_docs,
            "eos_id": h.eos_id,
            "tokenizer_sha256": h.tokenizer_sha256,
            "data_sha256": h.data_sha256,
            "file_bytes": expected_size(h.n_tokens, h.n_docs, h.itemsize),
        }

    def document(self, i: int) -> np.ndarray:
        """Ids of document ``i`` (a memmap view, no copy), including its trailing EOS if one was written."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document index {i} out of range for {self.n_docs} documents in {self.path}")
        return self.tokens[int(self.doc_offsets[i]) : int(self.doc_offsets[i + 1])]

    def window(self, start: int, length: int) -> torch.Tensor:
        """``tokens[start:start+length]`` as a torch tensor sharing the memmap's memory (no copy, read-only).

        The tensor's dtype is torch.uint16 or torch.uint32 (torch >= 2.3), which support few ops: convert with
        ``.long()`` (a copy) before arithmetic or embedding lookups.
        """
        if length < 0 or start < 0 or start + length > self.n_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside [0, {self.n_tokens}) of {self.path}")
        return _zero_copy_tensor(self.tokens[start : start + length])

    @property
    def n_blocks(self) -> int:
        """Number of 2**17-token blocks; the last one may be shorter."""
        return -(-self.n_tokens // BLOCK_TOKENS)

    def block(self, i: int) -> torch.Tensor:
        """Block ``i`` of ``BLOCK_TOKENS`` (2**17) tokens as a zero-copy tensor (the last block may be shorter)."""
        if not 0 <= i < self.n_blocks:
            raise IndexError(f"block index {i} out of range for {self.n_blocks} blocks in {self.path}")
        start = i * BLOCK_TOKENS
        return self.window(start, min(BLOCK_TOKENS, self.n_tokens - start))

    def _windows(self, length: int) -> np.ndarray:
        """A read-only (n_tokens - length + 1, length) view whose row i is ``tokens[i:i+length]`` (no copy)."""
        view = self._window_views.get(length)
        if view is None:
            base = np.asarray(self.tokens)  # plain ndarray: indexing an np.memmap subclass costs extra per call
            step = base.strides[0]
            view = np.lib.stride_tricks.as_strided(
                base, shape=(self.n_tokens - length + 1, length), strides=(step, step), writeable=False
            )
            self._window_views = {length: view}  # one length at a time: DynamicLength changes it rarely
        return view

    def gather(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for windows at ``starts``: two (B, seq_len) int64 tensors, targets shifted by one.

        One fancy-index copy of ``(B, seq_len + 1)`` ids (no per-row Python loop), then one widening copy. The
        index is applied to a strided "all windows" view of the memmap, which is the same gather as
        ``tokens[starts[:, None] + arange(T + 1)]`` without building the (B, T+1) index array (about 4x faster).
        """
        return self.gather_many([starts], seq_len)[0]

    def gather_many(
        self, starts_list: Sequence[np.ndarray], seq_len: int, *, pin_memory: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``gather`` for several batches of one ``seq_len`` with the two copies done once for all of them.

        Each batch's inputs and targets are contiguous row ranges of one ``(2, sum of B, seq_len)`` buffer (so a
        batch kept alive keeps its group's buffer alive). Per batch it costs less than separate ``gather`` calls,
        which is what the Loader's producer thread uses it for. ``pin_memory=True`` allocates that buffer in
        page-locked memory (one allocation instead of a pinned copy per batch; needs CUDA).

        Example: ``[(x0, y0), (x1, y1)] = tf.gather_many([starts0, starts1], 1024)``
        """
        return gather_windows(self.read_windows, starts_list, seq_len, pin_memory)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``tokens[s : s + length]`` for each start, as one ``(B, length)`` array in the file dtype (a copy).

        One fancy index on a strided "all windows" view of the memmap: the only read ``gather`` makes from it.
        Example: ``tf.read_windows(np.array([0, 4096]), 1025)  # (2, 1025) uint16``
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
        return self._windows(length)[starts]

    def verify(self, tokenizer: str | os.PathLike | Tokenizer | None = None, *, progress: bool = False) -> dict:
        """Check the data checksum, document index, every id < vocab_size and (optionally) the tokenizer identity.

        Raises TokenFileError on the first problem; returns a summary dict when all checks pass.

        Example: ``TokenFile("train.bin").verify("spm.model")`` (or a Hugging Face model directory, a ``Tokenizer``)
        """
        h = self.header
        digest = new_data_hash()
        max_id = -1
        bar = Bar(total=h.n_tokens, unit="tok", unit_scale=True, desc="verify", disable=not progress)
        for lo in range(0, h.n_tokens, _VERIFY_CHUNK):
            chunk = np.asarray(self.tokens[lo : lo + _VERIFY_CHUNK])
            digest.update(chunk.data.cast("B"))
            max_id = max(max_id, int(chunk.max()))
            bar.update(chunk.size)
        bar.close()
        digest.update(np.asarray(self.doc_offsets).tobytes())
        if digest.hexdigest() != h.data_sha256:
            raise TokenFileError(
                self.path, f"data checksum mismatch: expected sha256 {h.data_sha256}, found {digest.hexdigest()}"
            )
        if max_id >= h.vocab_size:
            raise TokenFileError(
                self.path, f"id out of range: expected ids < vocab_size {h.vocab_size}, found {max_id}"
            )
        offsets = np.asarray(self.doc_offsets)
        if offsets[0] != 0 or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise TokenFileError(self.path, "bad document index: expected offsets rising from 0, found a decrease")
        if h.eos_id is not None and h.eos_id >= h.vocab_size:
            raise TokenFileError(self.path, f"eos_id {h.eos_id} is not below vocab_size {h.vocab_size}")
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        return {"path": str(self.path), "n_tokens": h.n_tokens, "max_id": max_id, "data_sha256": h.data_sha256}

    def _check_tokenizer(self, tokenizer: str | os.PathLike | Tokenizer) -> None:
        from tokbin.text_tokenizer import load_tokenizer

        if self.tokenizer_sha256 is None:
            raise TokenFileError(self.path, f"no tokenizer recorded: expected one to compare with {tokenizer}")
        tok = load_tokenizer(tokenizer)
        found = tok.sha256
        if found != self.tokenizer_sha256:
            raise TokenFileError(
                self.path,
                f"tokenizer mismatch: file was encoded with sha256 {self.tokenizer_sha256}, {tokenizer} has {found}",
            )
        vocab = tok.vocab_size
        if vocab != self.vocab_size:
            raise TokenFileError(self.path, f"vocab_size mismatch: header {self.vocab_size}, {tokenizer} has {vocab}")
