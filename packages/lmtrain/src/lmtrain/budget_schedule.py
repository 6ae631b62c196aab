"""A learning-rate schedule sized to a wall-clock budget on a machine whose speed changes under it.

A schedule that decays to `min_lr` must know how many steps the budget allows, and on a shared CPU the speed
measured in the first seconds can be off several-fold a minute later (other processes come and go). So a
budgeted run trains in segments: warmup, then a constant learning rate (the "stable" phase of a
warmup-stable-decay schedule, trainloop's `wsd`) while the speed is measured on the real loop; at each re-plan
point the remaining budget times the speed of the last segment fixes the final step and the start of the linear
decay. Re-planning during the stable phase changes no learning rate already used, so the schedule stays
continuous; each segment ends with a checkpoint, and the next resumes it exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Fractions of the budget after which the plan is revised (the last segment runs to the end).
REPLAN_AT = (0.2, 0.55)
# The decay's share of all steps (linear to min_lr, as in warmup-stable-decay schedules).
DECAY_FRACTION = 0.4
# Plan for this fraction of the measured speed, so that the decay completes before the budget runs out.
SPEED_SAFETY = 0.92
_OPEN_END = 10**9


def open_ended(config: Any, end: int | None = None) -> Any:
    """The first segment's TrainConfig: warmup, then a constant learning rate up to step `end` (a generous guess
    that only sizes the progress bar; the first re-plan replaces it; None: no end in sight).

    Example:
        >>> open_ended(TrainConfig(lr=1e-3)).schedule  # doctest: +SKIP
        'wsd'
    """
    end = _OPEN_END if end is None else max(end, config.warmup_steps + 2)
    return dataclasses.replace(config, schedule="wsd", max_steps=end, t_max=end, wsd_decay_steps=1)


def plan(config: Any, step: int, steps_per_s: float, remaining_s: float) -> Any:
    """TrainConfig for the rest of the run: the final step the remaining budget allows, and where decay starts.

    The decay never starts before `step` (its learning rates are already spent); warmup is unchanged.

    Example:
        >>> plan(open_ended(cfg), step=100, steps_per_s=2.0, remaining_s=200.0).max_steps  # doctest: +SKIP
        468
    """
    total = step + max(1, int(steps_per_s * remaining_s * SPEED_SAFETY))
    total = max(total, config.warmup_steps + 1)
    decay = max(1, int(DECAY_FRACTION * total))
    decay = min(decay, total - max(step, config.warmup_steps))
    return dataclasses.replace(config, max_steps=total, t_max=total, wsd_decay_steps=max(1, decay))
