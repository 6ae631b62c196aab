"""A learning-rate schedule sized to a wall-clock budget on a machine whose speed changes under it.

A schedule that decays to ``min_lr`` must know how many steps the budget allows, and on a shared CPU the speed
measured in the first seconds can be off several-fold a minute later (other processes come and go). So
:class:`BudgetSchedule` starts as warmup followed by a constant learning rate (the "stable" phase of a
warmup-stable-decay schedule) while the loop measures its own speed; at fixed fractions of the budget it re-plans
in place: the remaining time times the speed since the previous re-plan fixes the final step and the start of a
linear decay to ``min_lr``. Re-planning during the stable phase changes no learning rate already used, so the
schedule stays continuous; a re-plan that comes after the decay began decays on from the current learning rate.
The plan is part of every checkpoint, so a resumed run continues the same schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from trainloop.config import TrainConfig

_OPEN_END = 10**9


@dataclass(frozen=True)
class BudgetPolicy:
    """How a run is sized to a wall-clock budget, every number in one place: how often it evaluates and when it
    stops early (:meth:`configure`), and when and how its schedule re-plans (:class:`BudgetSchedule`).

    Example:
        >>> cfg, first_guess = BudgetPolicy().configure(TrainConfig(), 260.0, step_s=0.2)
        >>> cfg.schedule, round(cfg.eval_every_s, 2), cfg.early_stopping_patience, first_guess
        ('wsd', 21.67, 3, 2600)
    """

    evals: int = 12  # evaluations per budget, on the configured subset of the validation split
    patience: int = 3  # evaluations in a row without a new best after which the run stops
    log_points: int = 25  # log at least every budget_s / log_points seconds' worth of steps (one step at least)
    replan_at: tuple[float, ...] = (0.2, 0.55)  # fractions of the budget after which the schedule re-plans
    decay_fraction: float = 0.4  # the decay's share of all steps (linear to min_lr, as in WSD schedules)
    speed_safety: float = 0.92  # plan for this fraction of the measured speed, so the decay ends in time

    def configure(
        self, config: TrainConfig, budget_s: float, step_s: float | None = None, *, keep: Collection[str] = ()
    ) -> tuple[TrainConfig, int | None]:
        """The TrainConfig of a run of ``budget_s`` seconds, and a first guess of its final step (twice what
        ``step_s``, a measured step time, allows; None without one) that only sizes the progress bar until the
        first re-plan. An evaluation every ``budget_s / evals`` seconds, the best checkpoint kept, early stopping
        after ``patience`` evaluations without a new best unless ``early_stopping_patience`` is in ``keep`` (the
        fields the user set)."""
        log_every = max(1, min(config.log_every, int(budget_s) // self.log_points))
        patience = config.early_stopping_patience if "early_stopping_patience" in keep else self.patience
        cfg = dataclasses.replace(config, log_every=log_every, schedule="wsd", eval_every=0, keep_best=True,
                                  eval_every_s=budget_s / self.evals, time_budget_s=budget_s,
                                  early_stopping_patience=patience)  # fmt: skip
        return cfg, None if step_s is None else int(2 * budget_s / step_s)

    def schedule(self, config: TrainConfig, first_guess: int | None = None) -> BudgetSchedule:
        """The :class:`BudgetSchedule` of ``config`` (a TrainConfig from :meth:`configure`)."""
        return BudgetSchedule(config, first_guess=first_guess, replan_at=self.replan_at,
                              decay_fraction=self.decay_fraction, speed_safety=self.speed_safety)  # fmt: skip


BUDGET = BudgetPolicy()


class BudgetSchedule:
    """Warmup, a constant learning rate, then a linear decay that ends when ``config.time_budget_s`` does.

    ``first_guess`` (optional) is a final step to show until the first re-plan (e.g. from a speed probe); it has no
    effect on the learning rates. Implements :class:`trainloop.schedules.Schedule`.

    Example:
        >>> cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, time_budget_s=100.0)
        >>> s = BudgetSchedule(cfg)
        >>> s.lr(50), s.observe(200, 20.0)
        (0.001, 're-planned at step 200: 10.00 steps/s -> 936 steps, decay from step 562')
        >>> s.max_steps, s.lr(936)
        (936, 0.0001)
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        first_guess: int | None = None,
        replan_at: tuple[float, ...] = BudgetPolicy.replan_at,
        decay_fraction: float = BudgetPolicy.decay_fraction,
        speed_safety: float = BudgetPolicy.speed_safety,
    ) -> None:
        if config.time_budget_s is None:
            raise ValueError("BudgetSchedule needs TrainConfig.time_budget_s (the budget it sizes the schedule to)")
        if list(replan_at) != sorted(set(replan_at)) or not all(0 < f < 1 for f in replan_at):
            raise ValueError(f"replan_at={replan_at!r} must be increasing fractions in (0, 1)")
        self.config = config
        self.budget_s = float(config.time_budget_s)
        self.replan_at = tuple(replan_at)
        self.decay_fraction = decay_fraction
        self.speed_safety = speed_safety
        self.max_steps = _OPEN_END if first_guess is None else max(first_guess, config.warmup_steps + 2)
        self.decay_start: int | None = None  # no decay until the first re-plan
        self.decay_from_lr = config.lr
        self.plans: list[dict[str, Any]] = []
        self._mark = (0, 0.0)  # (step, elapsed seconds) where the current speed measurement began

    def lr(self, step: int) -> float:
        cfg = self.config
        if step < cfg.warmup_steps:
            return cfg.min_lr + (cfg.lr - cfg.min_lr) * step / cfg.warmup_steps
        if self.decay_start is None or step < self.decay_start:
            return cfg.lr
        if step >= self.max_steps:
            return cfg.min_lr
        done = (step - self.decay_start) / (self.max_steps - self.decay_start)
        return self.decay_from_lr + (cfg.min_lr - self.decay_from_lr) * done

    def observe(self, step: int, elapsed_s: float) -> str | None:
        due = len(self.plans) < len(self.replan_at) and elapsed_s >= self.replan_at[len(self.plans)] * self.budget_s
        if not due:
            return None
        mark_step, mark_s = self._mark
        speed = (step - mark_step) / max(elapsed_s - mark_s, 1e-6)
        remaining = max(self.budget_s - elapsed_s, 0.0)
        warm = self.config.warmup_steps
        total = max(step + max(1, int(speed * remaining * self.speed_safety)), warm + 1)
        decay = max(1, min(int(self.decay_fraction * total), total - max(step, warm)))
        if self.decay_start is not None and step >= self.decay_start:
            # Already decaying: go on down from the current rate, so no rate already used changes.
            self.decay_from_lr = self.lr(step)
            decay = max(1, total - step)
        self.max_steps, self.decay_start = total, total - decay
        self._mark = (step, elapsed_s)
        self.plans.append({"at_step": step, "steps_per_s": round(speed, 3), "max_steps": total,
                           "decay_from": self.decay_start})  # fmt: skip
        return f"re-planned at step {step}: {speed:.2f} steps/s -> {total} steps, decay from step {self.decay_start}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "budget",
            "max_steps": self.max_steps,
            "decay_start": self.decay_start,
            "decay_from_lr": self.decay_from_lr,
            "plans": [dict(p) for p in self.plans],
            "mark": list(self._mark),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "budget":
            raise ValueError(f"schedule state of kind {state.get('kind')!r} cannot restore a BudgetSchedule")
        self.max_steps = int(state["max_steps"])
        self.decay_start = None if state["decay_start"] is None else int(state["decay_start"])
        self.decay_from_lr = float(state["decay_from_lr"])
        self.plans = [dict(p) for p in state["plans"]]
        self._mark = (int(state["mark"][0]), float(state["mark"][1]))
