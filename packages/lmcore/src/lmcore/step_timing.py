"""Timing a training step at a thread count, and choosing the thread count from such timings.

On a shared CPU the fastest thread count changes while a run goes: other work comes and goes, and two threads
that spin against it can be several times slower than one. A choice made once at start-up can be wrong for the
rest of the run; these two functions let a trainer re-check it cheaply (for example at each re-plan of a time
budget): `time_step` runs a few steps at one count (its cost is those steps, bounded by `steps`), and
`choose_threads` applies the switching rule to what was measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["StepTiming", "choose_threads", "time_step"]


@dataclass(frozen=True)
class StepTiming:
    """Medians per step over the timed steps: wall-clock seconds and this process's CPU seconds (all threads)."""

    threads: int
    wall_s: float
    cpu_s: float
    steps: int


def time_step(step: Callable[[], object], threads: int, *, steps: int = 3, warmup: int = 1) -> StepTiming:
    """Run `step` `warmup` + `steps` times with torch at `threads` threads; time the last `steps`.

    The thread count in force before the call is restored. `step` is one whole training step (forward, backward,
    optimizer), so what is timed is what the run would do; the steps it runs are real training or a throw-away copy,
    the caller's choice.

    Example:
        >>> import torch
        >>> x = torch.randn(64, 64)
        >>> timing = time_step(lambda: x @ x, threads=1, steps=2)
        >>> timing.threads, timing.steps, timing.wall_s > 0, torch.get_num_threads() >= 1
        (1, 2, True, True)
    """
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            step()
        walls, cpus = [], []
        for _ in range(steps):
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    finally:
        torch.set_num_threads(saved)
    return StepTiming(threads, statistics.median(walls), statistics.median(cpus), steps)


def choose_threads(wall_s: Mapping[int, float], current: int, *, margin: float = 0.1) -> int:
    """The thread count to run at, from wall seconds per step measured at each count in `wall_s`.

    The fastest count, unless it beats `current` by less than `margin` (a fraction of current's time): then
    `current`, so that noise does not make a run switch back and forth. `current` must be among the measured.

    Example:
        >>> choose_threads({1: 0.20, 2: 0.12}, current=1)  # 2 threads 40% faster: switch
        2
        >>> choose_threads({1: 0.20, 2: 0.19}, current=1)  # 5% faster: within the margin, stay
        1
        >>> choose_threads({1: 0.20, 2: 0.90}, current=2)  # other work came back: 2 threads 4.5x slower
        1
    """
    if not wall_s:
        raise ValueError("wall_s is empty: time at least the current thread count")
    for threads, seconds in wall_s.items():
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"wall_s keys must be positive thread counts, got {threads!r}")
        if not seconds > 0:
            raise ValueError(f"wall_s[{threads}] must be a positive number of seconds, got {seconds!r}")
    if current not in wall_s:
        raise ValueError(f"current={current!r} is not among the measured thread counts {sorted(wall_s)}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    fastest = min(wall_s, key=wall_s.__getitem__)
    return fastest if wall_s[fastest] < (1 - margin) * wall_s[current] else current
