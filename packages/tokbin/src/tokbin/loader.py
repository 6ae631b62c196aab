"""Background-prefetching batch loader over a TokenFile and a sampler, with exact resume and a real close()."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch
from prefetch_generator import BackgroundGenerator

from tokbin.tokenfile import TokenFile

_PUT_POLL_S = 0.05  # how often a producer blocked on a full queue checks for close()


class ClosableBackgroundGenerator(BackgroundGenerator):
    """prefetch_generator's BackgroundGenerator with ``close()``.

    The base class blocks forever in ``queue.put`` once the consumer stops reading; here the producer polls a
    stop event while waiting, and ``close()`` sets it, drains the queue and joins the thread. Producer exceptions
    are still re-raised in the consumer by the base class's ``next()``.
    """

    def __init__(self, generator: Iterator, max_prefetch: int = 3) -> None:
        self._halt = threading.Event()  # set before the base __init__ starts the thread
        super().__init__(generator, max_prefetch=max_prefetch)

    def _put(self, item: tuple) -> bool:
        while not self._halt.is_set():
            try:
                self.queue.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for item in self.generator:
                if not self._put((True, item)):
                    return
        except Exception as e:
            self._put((False, e))
        finally:
            self._put((False, StopIteration))
            close = getattr(self.generator, "close", None)
            if close is not None:
                close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer thread and wait for it; safe to call twice."""
        self._halt.set()
        self.Continue = False
        while self.is_alive():
            try:
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
            self.join(_PUT_POLL_S)
            timeout -= _PUT_POLL_S
            if timeout <= 0:
                raise RuntimeError("prefetch thread did not stop within the timeout (the producer is stuck)")


class Loader:
    """Iterator of ``(inputs, targets)`` int64 (B, T) tensors from ``token_file`` in the order ``sampler`` gives.

    Batches are gathered ``max_prefetch`` ahead in a background thread. ``state_dict()`` counts only the batches
    already handed out, so saving it and later calling ``load_state_dict`` resumes with the very next batch the
    consumer would have seen. With a CUDA ``device`` batches are pinned in the producer and copied with
    ``non_blocking=True``. Use ``close()`` or a ``with`` block to stop the thread.

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
        self._next_step = sampler.step  # the step of the next batch the consumer will receive
        self._bg: ClosableBackgroundGenerator | None = None

    def _produce(self, first_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = first_step
        while True:
            starts, seq_len = self.sampler.batch(step)
            x, y = self.token_file.gather(starts, seq_len)
            if self._pin:
                x, y = x.pin_memory(), y.pin_memory()
            yield x, y
            step += 1

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bg is None:
            self._bg = ClosableBackgroundGenerator(self._produce(self._next_step), self.max_prefetch)
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
