"""Learning-rate schedules as closed forms of the step: resume needs no scheduler state beyond the step."""

from __future__ import annotations

import math
from typing import Any, Protocol

from trainloop.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based: the first update uses ``lr_at(0)``).

    Warmup rises linearly from ``min_lr`` to ``lr`` over ``warmup_steps``; then
    ``cosine`` falls as ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p`` the fraction of
    ``t_max - warmup_steps`` elapsed, ``constant`` stays at ``lr``, and ``wsd`` (warmup-stable-decay) holds ``lr``
    until the last ``wsd_decay_steps`` before ``t_max`` and decays linearly to ``min_lr``. After ``t_max``: ``min_lr``
    (``lr`` for constant).

    Example:
        >>> cfg = TrainConfig(lr=3e-4, min_lr=1e-6, warmup_steps=500, t_max=10_000, max_steps=10_000)
        >>> lr_at(0, cfg), lr_at(500, cfg)
        (1e-06, 0.0003)
    """
    lr, low, warm = config.lr, config.min_lr, config.warmup_steps
    t_max = config.t_max if config.t_max is not None else config.max_steps
    if step < warm:
        return low + (lr - low) * step / warm
    if config.schedule == "constant":
        return lr
    if step >= t_max:
        return low
    if config.schedule == "cosine":
        progress = (step - warm) / max(1, t_max - warm)
        return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay = config.wsd_decay_steps if config.wsd_decay_steps is not None else max(1, (t_max - warm) // 10)
    decay_start = t_max - decay
    if step < decay_start:
        return lr
    return lr + (low - lr) * (step - decay_start) / max(1, decay)


class Schedule(Protocol):
    """What the loop asks every step: the learning rate of a step and the step the run ends at. ``observe`` lets
    a schedule re-plan itself in place from the training time so far (identical on every rank: the loop passes
    the ranks' agreed time); its state goes into every checkpoint."""

    max_steps: int

    def lr(self, step: int) -> float: ...

    def observe(self, step: int, elapsed_s: float) -> str | None:
        """Called after each optimizer step; returns a message when the plan changed, else None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ConfigSchedule:
    """The closed-form schedule of a TrainConfig (:func:`lr_at`), ending at ``max_steps``; it never re-plans.

    Example:
        >>> ConfigSchedule(TrainConfig(lr=1e-3, warmup_steps=10, max_steps=100)).lr(10)
        0.001
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.max_steps = config.max_steps

    def lr(self, step: int) -> float:
        return lr_at(step, self.config)

    def observe(self, step: int, elapsed_s: float) -> str | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "config"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "config":
            raise ValueError(f"schedule state of kind {state.get('kind')!r} cannot restore a ConfigSchedule")
