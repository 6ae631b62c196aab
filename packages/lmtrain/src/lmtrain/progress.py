"""Progress of a long step (tokenizer training, encoding, evaluation): a tqdm bar on a terminal, timestamped lines
elsewhere (a log file, a pipe, CI, or `--no-progress`), so that no step runs for minutes in silence.

A bar needs a terminal to redraw in place; written to a file it leaves one line per refresh. Elsewhere a
:class:`Progress` writes a line when the step starts, one about every ``every_s`` seconds while it runs (with the
fraction done where the total is known) and one when it ends, each led by ``[lmtrain HH:MM:SS]``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any


def bars_wanted(stream: IO[str] | None = None) -> bool:
    """Whether a progress bar can show: ``stream`` (stderr by default) is a terminal and neither ``--no-progress``
    nor ``TQDM_DISABLE=1`` turned bars off."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def say(message: str, stream: IO[str] | None = None) -> None:
    """One timestamped line, written whole."""
    stream = sys.stderr if stream is None else stream
    stream.write(f"[lmtrain {time.strftime('%H:%M:%S')}] {message}\n")
    stream.flush()


class Progress:
    """Report the progress of a step of ``total`` units (None: unknown) as a bar or as timestamped lines.

    Example (not a terminal: a line at the start, one at the end):
        >>> import io
        >>> out = io.StringIO()
        >>> with Progress("eval", total=4, unit="batches", stream=out) as progress:
        ...     for _ in range(4):
        ...         progress.update()
        >>> [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]  # doctest: +ELLIPSIS
        ['eval: started (4 batches)', 'eval: done, 4 batches in ... s']
    """

    def __init__(self, desc: str, total: int | None = None, *, unit: str = "it", stream: IO[str] | None = None,
                 every_s: float = 30.0, enabled: bool = True) -> None:  # fmt: skip
        self.desc, self.total, self.unit, self.every_s, self.enabled = desc, total, unit, every_s, enabled
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self._bar: Any = None
        self._t0 = self._last = time.perf_counter()

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        if bars_wanted(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit, file=self.stream, dynamic_ncols=True,
                             disable=False)  # fmt: skip
        else:
            size = f" ({self.total:,} {self.unit})" if self.total is not None else ""
            say(f"{self.desc}: started{size}", self.stream)
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            say(f"{self.desc}: {self.done:,}{'/' + format(self.total, ',') if self.total else ''} {self.unit}{share}, "
                f"{now - self._t0:.0f} s", self.stream)  # fmt: skip

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif kind is None:
            say(f"{self.desc}: done, {self.done:,} {self.unit} in {time.perf_counter() - self._t0:.1f} s", self.stream)


@contextlib.contextmanager
def step(desc: str, *, enabled: bool = True, stream: IO[str] | None = None, bar: bool = True) -> Iterator[bool]:
    """A long step whose own library draws a bar: yields whether to let it (a terminal); elsewhere writes
    timestamped lines when the step starts and when it is done, and yields False. ``bar=False``: a step with no bar
    of its own, whose lines are written on a terminal too.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with step("tokenizer: training", stream=out) as bar:
        ...     bar
        False
        >>> [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]  # doctest: +ELLIPSIS
        ['tokenizer: training', 'tokenizer: training: done in ... s']
    """
    if not enabled:
        yield False
        return
    if bar and bars_wanted(stream):
        yield True
        return
    t0 = time.perf_counter()
    say(desc, stream)
    yield False
    say(f"{desc}: done in {time.perf_counter() - t0:.1f} s", stream)
