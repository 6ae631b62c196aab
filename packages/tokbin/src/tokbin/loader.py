"""Background-prefetching batch loader over a TokenFile and a sampler, with exact resume and a real close()."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch
from prefetch_generator import BackgroundGenerator

from tokbin.tokenfile import TokenFile

_PUT_POLL_S = 0.05  # how often a producer blocked on a full queue checks for close()
# Batches per queue item in Loader, and per gather_many call in its producer. Every hand-off wakes the consumer
# thread and makes the two threads trade the GIL, which cost about as much as the gather itself on 2 shared cores
# (60-75 us per batch through the thread against 23 us for the gather alone); handing batches over 3 or 4 at a time
# brought it to 30-40 us per batch, and gathering them 3 or 4 at a time (one fancy index, one widening copy) took
# the producer's Python per batch down too.
_LOADER_GROUP = 4


class HandOff:
    """Bounded FIFO between one producer and one consumer thread, on two C-level ``queue.SimpleQueue``.

    ``ready`` holds the items and ``free`` one token per empty slot: ``put`` takes a token (waiting at most
    ``timeout`` s, else ``queue.Full``) and ``get`` gives one back. Unlike ``queue.Queue``, whose Python-level
    Condition runs a dozen lines under the GIL on both sides of every hand-off, each side here is two C calls; with
    the consumer waiting on the producer that raised the Loader from ~62% to ~69% of the benchmark's bound (median
    of 25 interleaved rounds), since those lines were what the two threads queued for the GIL to run.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(maxsize):
            self._free.put(None)

    def put(self, item: object, timeout: float | None = None) -> None:
        try:
            self._free.get(timeout=timeout)
        except queue.Empty:
            raise queue.Full from None
        self._ready.put(item)

    def get(self, block: bool = True) -> object:
        """The oldest item; waits for one unless ``block=False`` (then ``queue.Empty`` if there is none)."""
        item = self._ready.get(block)
        self._free.put(None)
        return item

    def full(self) -> bool:
        return self._free.empty()


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
    """prefetch_generator's BackgroundGenerator with ``close()``, hand-off of items in groups, and a lighter queue.

    The base class blocks forever in ``queue.put`` once the consumer stops reading; here the producer polls a
    stop event while waiting, and ``close()`` sets it, drains the queue and joins the thread. With ``group > 1``
    the producer puts lists of up to ``group`` items on the queue (a shorter one before an exception or the end),
    and the queue holds ``max(1, max_prefetch // group)`` of them, so at most ``max(max_prefetch, group)`` items
    wait in it. With ``grouped=True`` the generator yields those lists itself (each at most ``group`` long), so it
    decides when a group is handed over. Items arrive in order, and a producer exception is raised in the consumer
    after every item produced before it. The hand-off goes through ``self.handoff`` (a ``HandOff``), not the base
    class's ``queue.Queue``, which stays unused.

    Example::

        bg = ClosableBackgroundGenerator(iter(range(10)), max_prefetch=4, group=2)
        assert [next(bg) for _ in range(3)] == [0, 1, 2]
        bg.close()
    """

    def __init__(self, generator: Iterator, max_prefetch: int = 3, group: int = 1, *, grouped: bool = False) -> None:
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        if max_prefetch < 1:
            raise ValueError(f"max_prefetch must be >= 1, got {max_prefetch}")
        # set before the base __init__ starts the thread
        self._halt = threading.Event()
        self.group = group
        self.handoff = HandOff(max(1, max_prefetch // group))
        self._groups = generator if grouped else _in_groups(generator, group)
        self._pending: list = []  # the rest of the last group taken off the queue, reversed (pop() is the next item)
        super().__init__(generator, max_prefetch=max_prefetch)

    def _put(self, item: tuple) -> bool:
        while not self._halt.is_set():
            try:
                self.handoff.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for items in self._groups:
                if items and not self._put((True, items[::-1])):
                    return
        except Exception as e:
            self._put((False, e))
        finally:
            self._put((False, StopIteration))
            self._close_generator()

    def _close_generator(self) -> None:
        for generator in (self._groups, self.generator):
            close = getattr(generator, "close", None)
            if close is not None:
                close()

    def next(self):
        if self._pending:
            return self._pending.pop()
        if not self.Continue:
            raise StopIteration
        success, item = self.handoff.get()
        if not success:
            self.Continue = False
            raise item
        self._pending = item
        return item.pop()

    __next__ = next

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer thread and wait for it; safe to call twice."""
        self._halt.set()
        self.Continue = False
        self._pending = []
        while self.is_alive():
            try:
                while True:
                    self.handoff.get(block=False)
            except queue.Empty:
                pass
            self.join(_PUT_POLL_S)
            timeout -= _PUT_POLL_S
            if timeout <= 0:
                raise RuntimeError("prefetch thread did not stop within the timeout (the producer is stuck)")


class Loader:
    """Iterator of ``(inputs, targets)`` int64 (B, T) tensors from ``token_file`` in the order ``sampler`` gives.

    Batches are gathered ahead in a background thread and handed over ``min(max_prefetch, 4)`` per queue item
    (one thread wake-up per group rather than per batch); at most ``max_prefetch`` batches wait in the queue.
    ``state_dict()`` counts only the batches already handed out, so saving it and later calling
    ``load_state_dict`` resumes with the very next batch the consumer would have seen. With a CUDA ``device``
    batches are pinned in the producer and copied with ``non_blocking=True``. Use ``close()`` or a ``with`` block
    to stop the thread.

    Example::

        tf = TokenFile("train.bin")
        with Loader(tf, RandomWindows(tf.n_tokens, 1024, 16, seed=0)) as loader:
            x, y = next(loader)  # (16, 1024) int64 each; y[:, :-1] == x[:, 1:]
    """

    def __init__(self, token_file: TokenFile, sampler, *, device: str | torch.device = "cpu", max_prefetch: int = 3):
        if max_prefetch < 1:
            raise ValueError(f"max_prefetch must be >= 1, got {max_prefetch}")
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
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
        step, ready = first_step, None
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
