"""The loop's own state, and the small policies the loop asks each step: when to evaluate, which evaluation is the
best (and whether to stop early), when to save.

Each policy reads the config once and the :class:`TrainState` it is given; none of them runs a collective or
touches the model, so every rank, given the same agreed numbers, takes the same decision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainloop.config import TrainConfig

EVAL_SHARE = 0.1  # the most of the training time that evaluations every eval_every_s may take


@dataclass
class TrainState:
    """Everything the loop itself must carry across a resume; one ``state_dict`` in every checkpoint.

    Example:
        >>> state = TrainState(step=40, best=(30, 2.5))
        >>> TrainState.from_state_dict(state.state_dict()) == state
        True
    """

    step: int = 0
    tokens_seen: int = 0
    consecutive_skips: int = 0
    total_skips: int = 0
    train_seconds: float = 0.0  # training time of the run's earlier processes (a resumed run adds its own)
    best: tuple[int, float] | None = None  # (step, eval loss) of the best evaluation
    evals_since_best: int = 0
    next_eval_s: float = 0.0  # training time at which the next timed evaluation is due

    def state_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["best"] = list(self.best) if self.best is not None else None
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; fields the state lacks keep their value."""
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
        self.step, self.tokens_seen = int(self.step), int(self.tokens_seen)
        self.consecutive_skips, self.total_skips = int(self.consecutive_skips), int(self.total_skips)
        self.train_seconds, self.next_eval_s = float(self.train_seconds), float(self.next_eval_s)
        self.evals_since_best = int(self.evals_since_best)
        self.best = (int(self.best[0]), float(self.best[1])) if self.best else None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        new = cls()
        new.load_state_dict(state)
        return new


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on after a step, in one all-reduce: the mean loss, whether any rank was signalled,
    whether any rank is past the time budget, and the mean training time so far."""

    loss: float
    signal: bool
    over_budget: bool
    elapsed: float


class EvalPolicy:
    """When to evaluate: every ``eval_every`` steps, and each time ``eval_every_s`` seconds of training have passed,
    never on the last step (the loop evaluates once more after it). Timed evaluations take at most ``EVAL_SHARE``
    of the training time: after one that cost c seconds the next waits at least c / EVAL_SHARE.

    Example:
        >>> policy, state = EvalPolicy(TrainConfig(eval_every_s=10.0)), TrainState(step=5, next_eval_s=10.0)
        >>> policy.due(state, elapsed=12.0, last=False), state.next_eval_s
        (True, 20.0)
        >>> policy.after(state, elapsed=12.0, cost=1.5); state.next_eval_s
        27.0
    """

    def __init__(self, config: TrainConfig) -> None:
        self.every = config.eval_every
        self.every_s = config.eval_every_s

    def due(self, state: TrainState, elapsed: float, *, last: bool) -> bool:
        by_time = self.every_s > 0 and elapsed >= state.next_eval_s
        if by_time:
            while state.next_eval_s <= elapsed:
                state.next_eval_s += self.every_s
        return not last and (bool(self.every and state.step % self.every == 0) or by_time)

    def after(self, state: TrainState, elapsed: float, cost: float) -> None:
        """Record an evaluation's cost (the ranks' mean, so the decision is the same everywhere)."""
        if self.every_s:
            state.next_eval_s = max(state.next_eval_s, elapsed + cost / EVAL_SHARE)


class BestTracker:
    """Keeps the best evaluation and counts evaluations without a new best; early stopping after ``patience`` of
    them (0: never)."""

    def __init__(self, config: TrainConfig) -> None:
        self.patience = config.early_stopping_patience

    def observe(self, state: TrainState, loss: float) -> tuple[bool, bool]:
        """(whether ``loss`` is a new best, whether early stopping fires)."""
        improved = state.best is None or loss < state.best[1]
        if improved:
            state.best = (state.step, loss)
            state.evals_since_best = 0
        else:
            state.evals_since_best += 1
        return improved, bool(self.patience and state.evals_since_best >= self.patience)


class CheckpointPolicy:
    """When to save: every ``save_every`` steps (0: only at the end), and the step of each new best evaluation when
    ``keep_best``; never twice at one step."""

    def __init__(self, config: TrainConfig) -> None:
        self.every = config.save_every
        self.keep_best = config.keep_best

    def due(self, step: int, last_saved: int | None) -> bool:
        return bool(self.every and step % self.every == 0 and last_saved != step)

    def due_for_best(self, step: int, last_saved: int | None) -> bool:
        return self.keep_best and last_saved != step
