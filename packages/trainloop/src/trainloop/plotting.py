"""plot_metrics: loss, learning rate and gradient norms from metrics.jsonl to one PNG.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no ``matplotlib.use``), so plotting never changes
the backend or the open figures of the program that calls it. matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainloop.extras import import_extra

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(figsize: tuple[float, float], purpose: str) -> Figure:
    """An empty matplotlib Figure on its own Agg canvas (:class:`~trainloop.extras.MissingExtraError` if absent).

    Example:
        >>> fig = new_figure((8, 6), "plot_metrics")  # fig.subplots(...), fig.savefig("out.png")
        >>> type(fig.canvas).__name__, fig.get_size_inches().tolist()
        ('FigureCanvasAgg', [8.0, 6.0])
    """
    figure = import_extra("matplotlib.figure", "plot", purpose)
    backend_agg = import_extra("matplotlib.backends.backend_agg", "plot", purpose)
    fig = figure.Figure(figsize=figsize)
    backend_agg.FigureCanvasAgg(fig)
    return fig


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Three panels: train (and eval) loss, learning rate, total and per-group gradient norms (the groups only where
    there are two or more: one group's norm is the total). Lines that are not a
    JSON object (a last line cut short by a crash) are left out (:func:`~trainloop.metrics_logging.read_metrics`).

    Example:
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> out = tempfile.TemporaryDirectory()
        >>> run = Path(out.name)
        >>> records = [{"step": s, "loss": 4 / s, "lr": 1e-3} for s in range(1, 11)] + [{"step": 10, "eval_loss": 0.5}]
        >>> _ = (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
        >>> png = plot_metrics(run / "metrics.jsonl", run / "metrics.png")
        >>> png.name, png.read_bytes()[1:4]  # a PNG file's signature
        ('metrics.png', b'PNG')
        >>> out.cleanup()
    """
    from trainloop.metrics_logging import read_metrics

    records, _ = read_metrics(metrics_jsonl)
    train = [r for r in records if "loss" in r and r.get("loss") is not None]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        raise ValueError(f"{metrics_jsonl}: no training records to plot")
    steps = [r["step"] for r in train]
    fig = new_figure((8, 9), "plot_metrics")
    axes = fig.subplots(3, 1, sharex=True)
    axes[0].plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    axes[0].set_ylabel("loss (nats per target token)")
    axes[0].legend()
    axes[1].plot(steps, [r["lr"] for r in train])
    axes[1].set_ylabel("learning rate")
    axes[2].plot(steps, [r.get("grad_norm") for r in train], label="total", linewidth=2)
    groups = sorted({k for r in train for k in r if k.startswith("grad_norm/")})
    for key in groups if len(groups) > 1 else ():  # one group's norm is the total: the same line twice
        axes[2].plot(steps, [r.get(key) for r in train], label=key.split("/", 1)[1], alpha=0.7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("gradient L2 norm (before clipping)")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Drawn beside the target and renamed over it: a symbolic link there is replaced, never written through.
    from trainloop.checkpoint import refuse_linked

    refuse_linked(out)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}{out.suffix}")
    try:
        fig.savefig(tmp, dpi=90)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
