"""Gradient inspector: per-layer gradient-norm table and histograms (PNG) at chosen steps."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from trainloop.checkpoint import open_guarded
from trainloop.clipping import ClipGroups
from trainloop.extras import MissingExtraError
from trainloop.plotting import new_figure


def inspect_gradients(
    named_grads: list[tuple[str, torch.Tensor]], out_dir: Path, step: int, groups: ClipGroups, *, write: bool = True
) -> Path | None:
    """Write ``grads_step<N>.tsv`` (name, group, shape, L2 norm, max |g|, RMS) and ``grads_step<N>.png``
    (per-parameter norms and the distribution of log10 |g|), from full unscaled gradients. Without matplotlib (the
    ``plot`` extra) the table is still written and a one-line warning says the PNG was not.

    Example:
        >>> import os, tempfile, torch
        >>> from pathlib import Path
        >>> from trainloop.clipping import ClipGroups
        >>> model = torch.nn.Linear(4, 2)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> named_grads = [(name, p.grad) for name, p in model.named_parameters()]
        >>> groups = ClipGroups([name for name, _ in named_grads], {"weight": 1.0}, 1.0)
        >>> out = tempfile.TemporaryDirectory()
        >>> table = inspect_gradients(named_grads, Path(out.name), 100, groups)
        >>> sorted(os.listdir(out.name))  # the PNG needs the plot extra
        ['grads_step100.png', 'grads_step100.tsv']
        >>> [line.split("\\t")[:3] for line in table.read_text().splitlines()]
        [['name', 'group', 'shape'], ['weight', 'weight', '2x4'], ['bias', 'default', '2']]
        >>> out.cleanup()
    """
    if not write:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, g in named_grads:
        g = g.detach().float().cpu()
        norm = float(g.norm())
        rows.append((name, groups.group_names[groups.index_of[name]], tuple(g.shape), norm, float(g.abs().max()),
                     norm / max(g.numel(), 1) ** 0.5))  # fmt: skip
    table = out_dir / f"grads_step{step}.tsv"
    with open_guarded(table) as f:  # never through a symbolic or hard link
        f.write("name\tgroup\tshape\tnorm\tmax_abs\trms\n")
        for name, group, shape, norm, mx, rms in rows:
            f.write(f"{name}\t{group}\t{'x'.join(map(str, shape))}\t{norm:.6e}\t{mx:.6e}\t{rms:.6e}\n")

    try:
        fig = new_figure((12, max(4, 0.18 * len(rows))), f"TrainConfig.inspect_steps (grads_step{step}.png)")
    except MissingExtraError as exc:
        print(f"trainloop: warning: {exc}; wrote {table.name} only", file=sys.stderr, flush=True)
        return table
    ax1, ax2 = fig.subplots(1, 2)
    ax1.barh([r[0] for r in rows], [r[3] for r in rows])
    ax1.set_xscale("log")
    ax1.invert_yaxis()
    ax1.set_xlabel("gradient L2 norm")
    ax1.tick_params(axis="y", labelsize=6)
    values = torch.cat([g.detach().float().cpu().flatten().abs() for _, g in named_grads])
    values = values[values > 0]
    if values.numel():
        ax2.hist(values.log10().numpy(), bins=80)
    ax2.set_xlabel("log10 |gradient entry|")
    ax2.set_ylabel("count")
    fig.suptitle(f"gradients at step {step}")
    fig.tight_layout()
    with open_guarded(out_dir / f"grads_step{step}.png", "wb") as f:
        fig.savefig(f, dpi=80, format="png")
    return table
