"""How a run ended, as a value (:class:`RunSummary`, RUN_DIR/summary.json) and as people read it
(:func:`closing_block`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunSummary:
    """How a run ended: why it stopped (None: the planned end), the last step and loss, the final evaluation, the
    best evaluation, the last checkpoint, the tokens trained on, the skipped steps, the wall time, the re-plans of a
    budgeted schedule, and the plan it ran (lmtrain.run_plan.RunPlan)."""

    run_dir: Path
    stopped: str | None
    step: int
    loss: float | None
    eval: Mapping[str, float] | None
    best: Mapping[str, Any] | None
    checkpoint: str
    tokens_seen: int
    total_skips: int
    wall_s: float
    budget_plans: tuple[Mapping[str, Any], ...]
    plan: Any

    def to_dict(self) -> dict[str, Any]:
        """The summary as RUN_DIR/summary.json holds it (and `--json` prints it)."""
        fields = ("stopped", "loss", "eval", "step", "tokens_seen", "checkpoint", "best", "total_skips", "wall_s")
        return {name: getattr(self, name) for name in fields} | {"budget_plans": list(self.budget_plans)}


def stop_reason(summary: RunSummary) -> str:
    """Why the run ended, in words: the planned end (the time budget's, or the step count's) or what stopped it."""
    if summary.stopped is None:
        planned = summary.plan.train.max_steps
        return "time budget used" if summary.plan.budgeted else f"planned end (max_steps {planned:,})"
    return str(summary.stopped)


def closing_block(
    summary: RunSummary, next_commands: Sequence[str] = (), command_s: float | None = None, scored: str = ""
) -> str:
    """The end of a run as people read it: why it stopped, steps and tokens, the best checkpoint, the final
    evaluation with units and what it ``scored``, the wall time, where the weights and the plot are, and
    ``next_commands``."""
    from trainloop.metrics_logging import format_eval

    run_dir = summary.run_dir
    rows = [("stopped", f"{stop_reason(summary)}, at step {summary.step:,}"),
            ("trained", f"{summary.step:,} steps, {summary.tokens_seen:,} tokens"
                        + (f", {summary.total_skips} skipped" if summary.total_skips else ""))]  # fmt: skip
    if summary.loss is not None:
        rows.append(("last loss", f"{summary.loss:.4f} nats/token (training batch)"))
    if summary.eval:
        rows.append(("final eval", format_eval(dict(summary.eval)) + (f" ({scored})" if scored else "")))
    if summary.best:
        best_dir = Path(summary.checkpoint).parent / f"step_{int(summary.best['step']):08d}"
        rows.append(("best", f"step {int(summary.best['step']):,}, eval loss {summary.best['eval_loss']:.4f} "
                             f"nats/token -> {best_dir if best_dir.is_dir() else 'not kept'}"))  # fmt: skip
    rows.append(("weights", f"{summary.checkpoint} (last)"))
    wall = duration(summary.wall_s) + (f" training, {duration(command_s)} in all" if command_s is not None else "")
    rows.append(("wall time", wall))
    plot = run_dir / "loss.png"
    rows.append(("plot", str(plot) if plot.is_file() else "none (no metrics)"))
    rows += [("next" if i == 0 else "", command) for i, command in enumerate(next_commands)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["lmtrain: run finished", *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def duration(seconds: float) -> str:
    """``75.2`` -> ``'1 min 15 s'``; under a minute, whole seconds; over an hour, hours and minutes.

    Example:
        >>> duration(75.2), duration(3.25), duration(7300)
        ('1 min 15 s', '3.2 s', '2 h 01 min')
    """
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
