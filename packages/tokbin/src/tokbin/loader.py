"""Background-prefetching batch loader over a token dataset and a sampler, with exact resume and a real close()."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from prefetch_generator import BackgroundGenerator

from tokbin.tokenfile import TokenFile

_CLOSE_POLL_S = 0.02  # how often close() drains the queue while it waits for the producer thread to end
# Batches per queue item in Loader, and per gather_many call in its producer. Every hand-off wakes the consumer
# thread and makes the two threads trade the GIL, which cost about as much as the gather itself on 2 shared cores
# (60-75 us per batch through the thread against 23 us for the gather alone); handing batches over 3 or 4 at a time
# brought it to 30-40 us per batch, and gathering them 3 or 4 at a time (one fancy index, one widening copy) took
# the producer's Python per batch down too.
_LOADER_GROUP = 4


def _in_groups(items: Iterator, n: int) -> Iterator[list]:
    """Lists of ``n`` consecutive items (the last may be shorter); on an exception, the partial list comes first."""
    group: list = []
    try:
        for item in items:
            group.append(item)
            if len(group) == n:
                yield group
                group = []
    except Exception:
        if group:
            yield group
        raise
    if group:
        yield group


class ClosableBackgroundGenerator(BackgroundGenerator):
    """prefetch_generator's BackgroundGenerator with ``close()`` and hand-off of items in groups.

    The base class runs the generator in a daemon thread, hands its items over through a bounded ``queue.Queue``
    and re-raises a producer exception in the consumer after the items produced before it; all of that is used
    as it is. What it lacks is a way to stop: its thread blocks in ``queue.put`` for good once the consumer stops
    reading. Here the thread iterates a wrapper that ends the generator once ``close()`` has been called, and
    ``close()`` drains the queue until the thread has put its last item and exited (then the wrapped generator is
    closed, in the thread). With ``group > 1`` the thread puts lists of up to ``group`` items on the queue (a
    shorter one before an exception or the end), and the queue holds ``max(1, max_prefetch // group)`` of them,
    so at most ``max(max_prefetch, group)`` items wait in it. With ``grouped=True`` the generator yields those
    lists itself (each at most ``group`` long), so it decides when a group is handed over.

    Example:
        >>> bg = ClosableBackgroundGenerator(iter(range(10)), max_prefetch=4, group=2)
        >>> [next(bg) for _ in range(3)]
        [0, 1, 2]
        >>> bg.close()  # the thread has ended: nothing is left blocked on the queue
        >>> bg.is_alive()
        False
    """

    def __init__(self, generator: Iterator, max_prefetch: int = 3, group: int = 1, *, grouped: bool = False) -> None:
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        if max_prefetch < 1:
            raise ValueError(f"max_prefetch must be >= 1, got {max_prefetch}")
        self._halt = threading.Event()  # set before the base __init__ starts the thread
        self.group = group
        self._pending: list = []  # the rest of the last group taken off the queue, reversed (pop() is the next item)
        groups = generator if grouped else _in_groups(generator, group)
        super().__init__(self._until_closed(groups, generator), max_prefetch=max(1, max_prefetch // group))

    def _until_closed(self, groups: Iterator[list], source: Iterator) -> Iterator[list]:
        # What the base class's run() iterates in the thread: the non-empty groups, reversed, until close().
        try:
            for items in groups:
                if items:
                    yield items[::-1]
                if self._halt.is_set():
                    return
        finally:
            for generator in (groups, source):
                close = getattr(generator, "close", None)
                if close is not None:
                    close()

    def next(self):
        if not self._pending:
            self._pending = super().next()  # raises the producer's exception, then StopIteration
        return self._pending.pop()

    __next__ = next

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer thread and wait for it; safe to call twice."""
        self._halt.set()
        self.Continue = False  # the base class's next() now raises StopIteration
        self._pending = []
        deadline = time.monotonic() + timeout
        while self.is_alive():
            try:
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
            self.join(_CLOSE_POLL_S)
            if time.monotonic() > deadline:
                raise RuntimeError("prefetch thread did not stop within the timeout (the producer is stuck)")


class TokenDataset(Protocol):
    """The reading interface ``Loader`` needs, which ``TokenFile``, ``ShardedTokens`` and ``Blend`` share."""

    @property
    def n_tokens(self) -> int: ...

    def gather_many(
        self, starts_list: Sequence[np.ndarray], seq_len: int, *, pin_memory: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class Loader:
    """Iterator of ``(inputs, targets)`` int64 (B, T) tensors from ``token_file`` in the order ``sampler`` gives.

    ``token_file`` is a path, a ``TokenFile`` or any dataset with its reading interface (``n_tokens`` and
    ``gather_many``), such as a ``Blend`` read with a ``BlendWindows`` sampler. Batches are gathered ahead in a
    ``ClosableBackgroundGenerator`` thread and handed over ``min(max_prefetch, 4)`` per queue item
    (one thread wake-up per group rather than per batch); at most ``max_prefetch`` batches wait in the queue.
    ``state_dict()`` counts only the batches already handed out, so saving it and later calling
    ``load_state_dict`` resumes with the very next batch the consumer would have seen. With a CUDA ``device``
    batches are pinned in the producer and copied with ``non_blocking=True``. Use ``close()`` or a ``with`` block
    to stop the thread.

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> from tokbin import RandomWindows, write_tokens
        >>> out = tempfile.TemporaryDirectory()
        >>> tf = write_tokens(f"{out.name}/train.bin", np.arange(10_000) % 1000, vocab_size=1000)
        >>> with Loader(tf, RandomWindows(tf.n_tokens, 64, 16, seed=0)) as loader:
        ...     x, y = next(loader)
        >>> x.shape, x.dtype, bool((y[:, :-1] == x[:, 1:]).all())
        (torch.Size([16, 64]), torch.int64, True)
        >>> out.cleanup()
    """

    def __init__(
        self,
        token_file: TokenDataset | str | os.PathLike,
        sampler,
        *,
        device: str | torch.device = "cpu",
        max_prefetch: int = 3,
    ):
        if max_prefetch < 1:
            raise ValueError(f"max_prefetch must be >= 1, got {max_prefetch}")
        self.token_file = TokenFile(token_file) if isinstance(token_file, (str, os.PathLike)) else token_file
        drawn = getattr(sampler, "n_tokens", None)
        if isinstance(drawn, int) and drawn > self.token_file.n_tokens:
            raise ValueError(
                f"the sampler draws windows from {drawn} tokens, the data has {self.token_file.n_tokens}: "
                "expected a sampler built with this data's n_tokens"
            )
        self.sampler = sampler
        self.device = torch.device(device)
        self.max_prefetch = max_prefetch
        self._pin = self.device.type == "cuda"
        self._group = min(max_prefetch, _LOADER_GROUP)  # batches per queue item, and per gather_many call
        self._next_step = sampler.step  # the step of the next batch the consumer will receive
        self._bg: ClosableBackgroundGenerator | None = None

    def _produce(self, first_step: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        # Groups of batches, for ClosableBackgroundGenerator(grouped=True). A group is gathered with
        # TokenFile.gather_many (the two copies once per group, runs of equal seq_len together) and yielded only
        # after the next group's windows are drawn, so the hand-off comes right before the next copies: the consumer
        # it wakes then finds the GIL free (numpy drops it while copying) instead of waiting for the producer's
        # Python. A sampler error comes after the batches drawn before it.
        step = first_step
        ready: list[tuple[torch.Tensor, torch.Tensor]] = []
        while True:
            specs: list[tuple[np.ndarray, int]] = []
            failure: Exception | None = None
            try:
                while len(specs) < self._group:
                    specs.append(self.sampler.batch(step + len(specs)))
            except Exception as exc:
                failure = exc
            step += len(specs)
            if ready:
                yield ready
            ready = []
            first = 0
            while first < len(specs):
                seq_len = specs[first][1]
                last = first + 1
                while last < len(specs) and specs[last][1] == seq_len:
                    last += 1
                starts = [st for st, _ in specs[first:last]]
                ready += self.token_file.gather_many(starts, seq_len, pin_memory=self._pin)
                first = last
            if failure is not None:
                if ready:
                    yield ready
                raise failure

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bg is None:
            producer = self._produce(self._next_step)
            self._bg = ClosableBackgroundGenerator(producer, self.max_prefetch, self._group, grouped=True)
        x, y = next(self._bg)
        self._next_step += 1
        if self._pin:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

    def state_dict(self) -> dict:
        """The sampler state as of the batches delivered so far (prefetched batches are not counted)."""
        return {"sampler": {**self.sampler.state_dict(), "step": self._next_step}}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: stops the prefetch thread; the next batch is the first not yet delivered."""
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        self._next_step = self.sampler.step

    def close(self) -> None:
        """Stop the prefetch thread (it restarts from the current position on the next ``next()``)."""
        if self._bg is not None:
            self._bg.close()
            self._bg = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_bg", None) is not None:
            self.close()
