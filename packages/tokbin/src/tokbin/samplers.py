"""Batch samplers: which windows each batch reads. Every batch is a pure function of (seed, step, rank, world_size).

A sampler yields ``(starts, seq_len)``: a (B,) int64 array of window starts and the window length T; the window
reads ``T + 1`` tokens so targets can be shifted by one. Because batch ``k`` depends only on the configuration
and ``k``, ``state_dict()`` is the step counter plus the configuration it is valid for, and a resumed run sees
exactly the batches it would have seen. Distributed ranks take interleaved slices of one global batch stream, so
their samples are disjoint and their union is the single-process stream of a ``world_size``-times larger batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

_CHUNK_STEPS = 64  # random batches drawn per generator: seeding a Generator costs more than drawing a batch


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def _check_step(step: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def _too_short(n_tokens: int, found: str, longest: int) -> ValueError:
    """The one-line error for data too short for its windows: the token count, seq_len, and what would fit."""
    fix = f"use more text, or a seq_len of at most {longest}" if longest >= 1 else "use more text"
    return ValueError(f"the data has {n_tokens} tokens, {found}: {fix}")


class _Sampler:
    """Step counter, iteration and state handling shared by the samplers."""

    step: int
    rank: int
    world_size: int

    def batch(self, step: int) -> tuple[np.ndarray, int]:
        raise NotImplementedError

    def _config(self) -> dict:
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        while True:
            out = self.batch(self.step)
            self.step += 1
            yield out

    def state_dict(self) -> dict:
        """JSON-able state: the next step and the configuration it belongs to."""
        return {"step": self.step, **self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; raises ValueError if it came from a sampler configured differently.

        A state saved by a rank of another world size (every rank at the same step) re-splits the stream over this
        sampler's ranks: see :meth:`_reshard`.
        """
        mine = self._config()
        for key, value in mine.items():
            if key in ("rank", "world_size"):
                continue
            if key in state and state[key] != value:
                raise ValueError(f"{type(self).__name__} state: {key} is {state[key]!r}, this sampler has {value!r}")
        if int(state["step"]) < 0:
            raise ValueError(f"{type(self).__name__} state: step must be >= 0, got {state['step']}")
        self.step = int(state["step"])
        if state.get("world_size", self.world_size) != self.world_size:
            self._reshard(state)
        else:
            self._restore(state)

    def _reshard(self, state: dict) -> None:
        """Continue at the same step with this rank's share of the global batch of the new world size (random
        samplers draw with replacement: there is no epoch to keep whole)."""

    def _restore(self, state: dict) -> None:
        """Restore state beyond the step counter (none for most samplers)."""


class _RandomStream(_Sampler):
    """Random rows drawn in chunks of 64 steps per generator: ``stream_width`` starts per step of the run that began
    the stream (its ``batch_size x world_size``). A re-split to a global batch of another width continues that
    stream at the first row not yet read (``base_row``, from step ``base_step``)."""

    seed: int
    batch_size: int
    seq_len: int
    stream_width: int
    base_step: int
    base_row: int
    _chunk_index: int
    _chunk: np.ndarray | None

    def _start_stream(self) -> None:
        self.stream_width, self.base_step, self.base_row = self.batch_size * self.world_size, 0, 0
        self._chunk_index, self._chunk = -1, None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stream": [self.stream_width, self.base_step, self.base_row]}

    def _draw(self, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        """``shape`` window starts drawn from ``rng``."""
        raise NotImplementedError

    def _chunk_rows(self, chunk_index: int) -> np.ndarray:
        """The stream's steps ``chunk_index * 64 ..`` as a (64, stream_width) array of window starts."""
        if self._chunk is None or chunk_index != self._chunk_index:
            rng = np.random.default_rng([self.seed, chunk_index])
            self._chunk = self._draw(rng, (_CHUNK_STEPS, self.stream_width))
            self._chunk_index = chunk_index
        return self._chunk

    def batch(self, step: int) -> tuple[np.ndarray, int]:
        _check_step(step)
        width = self.batch_size * self.world_size
        if width == self.stream_width and self.base_row == self.base_step * width:  # the stream's own grid
            chunk_index, row = divmod(step, _CHUNK_STEPS)
            return self._chunk_rows(chunk_index)[row, self.rank :: self.world_size], self.seq_len
        if step < self.base_step:
            raise ValueError(f"step {step} comes before the re-split at step {self.base_step}")
        first = self.base_row + (step - self.base_step) * width  # the stream's rows first .. first + width - 1
        flat = np.arange(first, first + width)
        per_chunk = _CHUNK_STEPS * self.stream_width
        starts = np.empty(width, dtype=np.int64)
        for chunk_index in np.unique(flat // per_chunk):
            here = flat // per_chunk == chunk_index
            starts[here] = self._chunk_rows(int(chunk_index)).reshape(-1)[flat[here] % per_chunk]
        return starts[self.rank :: self.world_size], self.seq_len

    def _position(self, state: dict) -> tuple[int, int, int]:
        """(stream_width, base_step, base_row) of a saved state; a state without them began its own stream."""
        if state.get("stream"):
            width, base_step, base_row = (int(v) for v in state["stream"])
            return width, base_step, base_row
        return int(state.get("batch_size", self.batch_size)) * int(state.get("world_size", self.world_size)), 0, 0

    def _restore(self, state: dict) -> None:
        self.stream_width, self.base_step, self.base_row = self._position(state)
        self._chunk_index, self._chunk = -1, None

    def _reshard(self, state: dict) -> None:
        """Continue the saved stream at its first unread row: the old ranks read ``step`` batches of their global
        width; this world's wider or narrower global batches take the rows after those, so no window the run has
        read comes back at this step (the stream stays the one an uninterrupted run draws)."""
        width, base_step, base_row = self._position(state)
        old_width = int(state.get("batch_size", self.batch_size)) * int(state["world_size"])
        self.stream_width, self.base_step = width, self.step
        self.base_row = base_row + (self.step - base_step) * old_width
        self._chunk_index, self._chunk = -1, None


class RandomWindows(_RandomStream):
    """Windows at uniformly random starts, with replacement; rank r of W takes rows r, r+W, ... of the global batch.

    Example:
        >>> s = RandomWindows(100_000, seq_len=1024, batch_size=16, seed=0)
        >>> starts, seq_len = s.batch(0)
        >>> starts.shape, seq_len, bool((starts + seq_len + 1 <= 100_000).all())  # each window and its next token fit
        ((16,), 1024, True)
        >>> rank1 = RandomWindows(100_000, seq_len=1024, batch_size=8, seed=0, rank=1, world_size=2)
        >>> bool((rank1.batch(0)[0] == starts[1::2]).all())  # rank 1 of 2: every other row of the same global batch
        True
    """

    def __init__(self, n_tokens: int, seq_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
        _check_rank(rank, world_size)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if n_tokens < seq_len + 1:
            found = f"fewer than one window at seq_len {seq_len} ({seq_len + 1} tokens with the last target)"
            raise _too_short(n_tokens, found, n_tokens - 1)
        self.n_tokens, self.seq_len, self.batch_size = n_tokens, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0
        self._start_stream()

    def _config(self) -> dict:
        keys = ("n_tokens", "seq_len", "batch_size", "seed", "rank", "world_size")
        return {k: getattr(self, k) for k in keys}

    def _draw(self, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        high = self.n_tokens - self.seq_len  # exclusive: the last start still has seq_len + 1 tokens
        return rng.integers(0, high, size=shape)


class EpochWindows(_Sampler):
    """Non-overlapping windows, reshuffled every epoch; every window (hence every input token) once per epoch.

    Window i starts at ``i * seq_len``. Each epoch's permutation comes from (seed, epoch). With ``world_size`` W
    the permutation is padded with its own head to a multiple of W (as torch's DistributedSampler does) and rank
    r takes positions r, r+W, ...: ranks are disjoint when the window count divides by W. The last batch of an
    epoch is smaller when the rank's share does not divide by ``batch_size``; ``epoch_of(step)`` tells the epoch.

    Example:
        >>> import numpy as np
        >>> s = EpochWindows(100_000, seq_len=1024, batch_size=16, seed=0)
        >>> s.n_windows, s.batches_per_epoch  # 99_999 // 1024 windows, ceil(97 / 16) batches
        (97, 7)
        >>> epoch = [s.batch(step)[0] for step in range(s.batches_per_epoch)]
        >>> [len(starts) for starts in epoch]
        [16, 16, 16, 16, 16, 16, 1]
        >>> sorted(np.concatenate(epoch).tolist()) == [i * 1024 for i in range(97)]  # every window once per epoch
        True
    """

    def __init__(self, n_tokens: int, seq_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
        _check_rank(rank, world_size)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        self.n_windows = (n_tokens - 1) // seq_len
        if self.n_windows < world_size:
            found = f"{self.n_windows} windows at seq_len {seq_len}, fewer than world_size {world_size}"
            raise _too_short(n_tokens, found, (n_tokens - 1) // world_size)
        self.n_tokens, self.seq_len, self.batch_size = n_tokens, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.per_rank = math.ceil(self.n_windows / world_size)
        self.batches_per_epoch = math.ceil(self.per_rank / batch_size)
        self.step = 0
        self._epoch = -1
        self._mine: np.ndarray | None = None
        # After a re-split to another world size: (epoch, windows of its permutation already read, first step).
        self.resumed: tuple[int, int, int] | None = None
        self._resumed_mine: np.ndarray | None = None

    def _config(self) -> dict:
        keys = ("n_tokens", "seq_len", "batch_size", "seed", "rank", "world_size")
        return {k: getattr(self, k) for k in keys}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "resumed": list(self.resumed) if self.resumed else None}

    def _restore(self, state: dict) -> None:
        if state.get("resumed"):
            epoch, read, first = (int(v) for v in state["resumed"])
            self.resumed = (epoch, read, first)
        else:
            self.resumed = None
        self._resumed_mine = None

    def _reshard(self, state: dict) -> None:
        """Re-split the rest of the current epoch over this world size: windows the old ranks read together (a
        prefix of the epoch's permutation) are not read again, the rest are each read once; later epochs follow
        the new layout."""
        old = EpochWindows(self.n_tokens, self.seq_len, self.batch_size, seed=self.seed, rank=0,
                           world_size=int(state["world_size"]))  # fmt: skip
        old._restore(state)
        epoch, read = old.position(self.step)
        self.resumed = (epoch, read, self.step) if read < self.n_windows else (epoch + 1, 0, self.step)
        self._resumed_mine = None

    def _resumed_batches(self, read: int) -> int:
        return math.ceil(math.ceil((self.n_windows - read) / self.world_size) / self.batch_size)

    def _locate(self, step: int) -> tuple[int, int, int | None]:
        """(epoch, batch index in it, and for the re-split epoch the windows of its permutation read before the
        re-split, None for an epoch in the regular layout) of a step."""
        if self.resumed is not None and step >= self.resumed[2]:
            epoch, read, first = self.resumed
            k = step - first
            if k < self._resumed_batches(read):
                return epoch, k, read
            e, k = divmod(k - self._resumed_batches(read), self.batches_per_epoch)
            return epoch + 1 + e, k, None
        e, k = divmod(step, self.batches_per_epoch)
        return e, k, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, windows of that epoch's permutation read by all ranks together) before batch ``step``."""
        epoch, k, read_before = self._locate(step)
        start = 0 if read_before is None else read_before
        return epoch, min(start + k * self.batch_size * self.world_size, self.n_windows)

    def epoch_of(self, step: int) -> int:
        return self._locate(step)[0]

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def _windows(self, epoch: int) -> np.ndarray:
        if self._mine is None or epoch != self._epoch:
            padded = np.resize(self._permutation(epoch), self.per_rank * self.world_size)  # repeats from the start
            self._mine = padded[self.rank :: self.world_size]
            self._epoch = epoch
        return self._mine

    def batch(self, step: int) -> tuple[np.ndarray, int]:
        _check_step(step)
        epoch, k, read_before = self._locate(step)
        if read_before is not None:
            if self._resumed_mine is None:
                rest = self._permutation(epoch)[read_before:]
                padded = np.resize(rest, math.ceil(len(rest) / self.world_size) * self.world_size)
                self._resumed_mine = padded[self.rank :: self.world_size]
            mine = self._resumed_mine
        else:
            mine = self._windows(epoch)
        windows = mine[k * self.batch_size : (k + 1) * self.batch_size]
        return windows.astype(np.int64) * self.seq_len, self.seq_len


def blend_probabilities(weights: Sequence[float]) -> np.ndarray:
    """Relative weights as probabilities summing to 1; ValueError for a negative or non-finite weight or a zero sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights must be a non-empty list of numbers, got {weights!r}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        raise ValueError(f"weights[{bad[0]}] must be a finite number >= 0, got {weights[bad[0]]!r}")
    if w.sum() <= 0:
        raise ValueError(f"weights must not all be 0, got {list(weights)}")
    return w / w.sum()


class BlendWindows(_RandomStream):
    """Random windows over a blend of sources: each row draws its source by weight, then a start inside it.

    Source i holds positions ``[offset_i, offset_i + sizes[i])`` of the blend (offsets are the running sums of
    ``sizes``, as in ``Blend.offsets``), and a row's window of ``seq_len + 1`` tokens lies inside its source, so
    no window mixes two sources. Rows are independent: the number of rows from source i in N draws is
    Binomial(N, weights[i] / sum(weights)). Rank r of W takes rows r, r+W, ... of the global batch, as in
    RandomWindows; ``state_dict()`` holds the sizes and weights, so a state resumes only on the same blend.

    Example::

        s = BlendWindows([n_web, n_books, n_code], [0.7, 0.2, 0.1], seq_len=1024, batch_size=16, seed=0)
        starts, T = s.batch(0)  # 16 blend positions; about 70% of rows fall in the first source
    """

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        _check_rank(rank, world_size)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if len(sizes) != len(weights):
            raise ValueError(f"one weight per source: got {len(sizes)} sizes and {len(weights)} weights")
        self.sizes, self.weights = [int(n) for n in sizes], [float(w) for w in weights]
        self._p = blend_probabilities(self.weights)
        for i, (n, p) in enumerate(zip(self.sizes, self._p, strict=True)):
            if p > 0 and n < seq_len + 1:
                raise ValueError(
                    f"source {i} has {n} tokens, fewer than a window of seq_len + 1 ({seq_len + 1}): "
                    "give it weight 0 or use a shorter seq_len"
                )
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0
        self._offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        # exclusive upper bound of a start inside each source (1 for an unused source too short for a window)
        self._highs = np.maximum(np.asarray(self.sizes, dtype=np.int64) - seq_len, 1)
        self._start_stream()

    def _config(self) -> dict:
        keys = ("sizes", "weights", "seq_len", "batch_size", "seed", "rank", "world_size")
        return {k: getattr(self, k) for k in keys}

    def _draw(self, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        source = rng.choice(len(self.sizes), size=shape, p=self._p)
        return self._offsets[source] + rng.integers(0, self._highs[source])


@dataclass(frozen=True)
class SeqLenWarmup:
    """Sequence-length warmup schedule: powers of two from ``start`` to ``end`` over ``steps`` steps.

    The length grows linearly in log2 and is rounded down to a power of two, so it always divides a power-of-two
    tokens-per-batch. Example: ``SeqLenWarmup(64, 1024, 1000)(0) == 64`` and ``(1000) == 1024``.
    """

    start: int = 64
    end: int = 1024
    steps: int = 1000

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SeqLenWarmup.{name} must be a power of two >= 1, got {v}")
        if self.end < self.start:
            raise ValueError(f"SeqLenWarmup.end ({self.end}) must be >= start ({self.start})")
        if self.steps < 0:
            raise ValueError(f"SeqLenWarmup.steps must be >= 0, got {self.steps}")

    def __call__(self, step: int) -> int:
        if step >= self.steps:
            return self.end
        lo, hi = math.log2(self.start), math.log2(self.end)
        return 1 << int(lo + (hi - lo) * step / self.steps)


@dataclass(frozen=True)
class DocumentLengths:
    """Pick each batch's length from the document it draws: the smallest bucket that holds it (else the largest).

    Every window then starts at the start of a randomly drawn document, e.g. 256 for short text, 1024 for long.
    Example: ``DocumentLengths(tf.doc_offsets, buckets=(256, 1024))``.
    """

    doc_offsets: np.ndarray
    buckets: tuple[int, ...] = (256, 1024)

    def __post_init__(self) -> None:
        if len(self.doc_offsets) < 2:
            raise ValueError("DocumentLengths.doc_offsets must hold at least one document (2 offsets)")
        if not self.buckets or list(self.buckets) != sorted(self.buckets) or self.buckets[0] < 1:
            raise ValueError(f"DocumentLengths.buckets must be increasing positive lengths, got {self.buckets}")


class DynamicLength(_Sampler):
    """Sequence length chosen per batch at a constant ``tokens_per_batch``: B = tokens_per_batch // T, no padding.

    ``seq_len_schedule`` is an int, a callable ``step -> T`` (e.g. ``SeqLenWarmup(64, 1024, 1000)``) or a
    ``DocumentLengths``. Each T must divide ``tokens_per_batch``. Windows are random (or document starts, with
    DocumentLengths); rank r of W takes rows r, r+W, ... of a global batch of ``W * B`` rows.

    Example::

        s = DynamicLength(tf.n_tokens, 16384, SeqLenWarmup(64, 1024, 500), seed=0)
        starts, T = s.batch(0)  # T == 64, starts.shape == (256,)
    """

    def __init__(
        self,
        n_tokens: int,
        tokens_per_batch: int,
        seq_len_schedule: int | Callable[[int], int] | DocumentLengths,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        _check_rank(rank, world_size)
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        self.n_tokens, self.tokens_per_batch, self.schedule = n_tokens, tokens_per_batch, seq_len_schedule
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0
        if isinstance(seq_len_schedule, DocumentLengths):
            self._doc_starts = np.asarray(seq_len_schedule.doc_offsets[:-1], dtype=np.int64)
            self._doc_lens = np.diff(np.asarray(seq_len_schedule.doc_offsets, dtype=np.int64))

    def _config(self) -> dict:
        keys = ("n_tokens", "tokens_per_batch", "seed", "rank", "world_size")
        return {k: getattr(self, k) for k in keys}

    def _seq_len(self, step: int, rng: np.random.Generator) -> tuple[int, int | None]:
        s = self.schedule
        if isinstance(s, DocumentLengths):
            anchor = int(rng.integers(0, len(self._doc_lens)))
            fits = [b for b in s.buckets if b >= self._doc_lens[anchor]]
            return (fits[0] if fits else s.buckets[-1]), anchor
        return (s if isinstance(s, int) else int(s(step))), None

    def batch(self, step: int) -> tuple[np.ndarray, int]:
        _check_step(step)
        rng = np.random.default_rng([self.seed, step])
        seq_len, anchor = self._seq_len(step, rng)
        if seq_len < 1 or self.tokens_per_batch % seq_len:
            raise ValueError(f"step {step}: seq_len {seq_len} does not divide tokens_per_batch {self.tokens_per_batch}")
        if seq_len + 1 > self.n_tokens:
            found = f"fewer than one window at seq_len {seq_len} ({seq_len + 1} tokens) at step {step}"
            raise _too_short(self.n_tokens, found, self.n_tokens - 1)
        rows = self.tokens_per_batch // seq_len * self.world_size
        high = self.n_tokens - seq_len
        if anchor is None:
            starts = rng.integers(0, high, size=rows)
        else:
            docs = rng.integers(0, len(self._doc_starts), size=rows)
            docs[0] = anchor
            starts = np.minimum(self._doc_starts[docs], high - 1)
        return starts[self.rank :: self.world_size], seq_len
