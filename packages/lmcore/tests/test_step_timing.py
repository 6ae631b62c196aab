"""lmcore.step_timing: time_step runs what it says at the thread count it says; choose_threads' switching rule."""

import pytest
import torch

from lmcore.step_timing import choose_threads, time_step


def test_time_step_runs_warmup_and_steps_at_the_given_threads_and_restores():
    seen = []
    before = torch.get_num_threads()
    target = 2 if before == 1 else 1
    timing = time_step(lambda: seen.append(torch.get_num_threads()), target, steps=4, warmup=2)
    assert seen == [target] * 6
    assert torch.get_num_threads() == before
    assert (timing.threads, timing.steps) == (target, 4)
    assert timing.wall_s >= 0 and timing.cpu_s >= 0


def test_time_step_restores_threads_when_the_step_fails():
    before = torch.get_num_threads()

    def failing():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        time_step(failing, 2 if before == 1 else 1)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(threads=0), "threads must be a positive int"), (dict(threads=1, steps=0), "steps must be a positive int")],
)
def test_time_step_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_step(lambda: None, **kwargs)


@pytest.mark.parametrize(
    "wall_s, current, expected",
    [
        ({1: 0.20, 2: 0.12}, 1, 2),  # faster by 40%: switch
        ({1: 0.20, 2: 0.185}, 1, 1),  # faster by 7.5%, inside the 10% margin: stay
        ({1: 0.20, 2: 0.90}, 2, 1),  # other work came back: one thread
        ({1: 0.20}, 1, 1),  # only the current count measured
        ({1: 0.30, 2: 0.25, 4: 0.10}, 2, 4),
    ],
)
def test_choose_threads(wall_s, current, expected):
    assert choose_threads(wall_s, current) == expected


def test_choose_threads_margin_zero_takes_any_gain():
    assert choose_threads({1: 0.20, 2: 0.199}, 1, margin=0.0) == 2


@pytest.mark.parametrize(
    "wall_s, current, message",
    [
        ({}, 1, "wall_s is empty"),
        ({1: 0.2}, 2, r"current=2 is not among the measured thread counts \[1\]"),
        ({1: 0.2, 0: 0.1}, 1, "keys must be positive thread counts"),
        ({1: 0.2, 2: float("nan")}, 1, r"wall_s\[2\] must be a positive number"),
    ],
)
def test_choose_threads_rejects_bad_input(wall_s, current, message):
    with pytest.raises(ValueError, match=message):
        choose_threads(wall_s, current)
