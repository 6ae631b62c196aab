"""Per-group gradient clipping: groups by parameter-name patterns, norms on unscaled gradients.

Under ZeRO each rank holds only its partition of every gradient, so the engine hands in the local pieces and the
squared sums are all-reduced before the square root; plain torch and DDP hand in full (already averaged) gradients.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainloop.distributed import all_reduce_sum

DEFAULT_GROUP = "default"


@dataclass
class ClipReport:
    """One step's clipping: per-group norms before clipping and the factor applied (1.0 = untouched)."""

    norms: dict[str, float]
    factors: dict[str, float]
    total_norm: float


class ClipGroups:
    """Assigns parameter names to clipping groups and clips each group to its own threshold.

    ``patterns`` maps fnmatch patterns to thresholds; the first matching pattern wins; names matching none form
    ``"default"`` with threshold ``default_clip`` (0 means: measured, never clipped).

    Example:
        >>> names = ["emb.weight", "blocks.0.o_proj.weight", "head.weight"]
        >>> groups = ClipGroups(names, {"emb.*": 2.0, "*.o_proj.*": 0.5}, 1.0)
        >>> groups.group_names
        ['emb.*', '*.o_proj.*', 'default']
    """

    def __init__(self, param_names: Sequence[str], patterns: dict[str, float] | None, default_clip: float) -> None:
        patterns = dict(patterns or {})
        self.group_names: list[str] = list(patterns) + [DEFAULT_GROUP]
        self.thresholds: list[float] = [float(v) for v in patterns.values()] + [float(default_clip)]
        self.index_of: dict[str, int] = {}
        for name in param_names:
            idx = len(patterns)
            for i, pattern in enumerate(patterns):
                if fnmatch.fnmatchcase(name, pattern):
                    idx = i
                    break
            self.index_of[name] = idx
        self._cached_names: tuple[str, ...] = ()
        self._cached_index = torch.zeros(0, dtype=torch.long)
        used = set(self.index_of.values())
        unused = [self.group_names[i] for i in range(len(patterns)) if i not in used]
        if unused:
            raise ValueError(
                f"TrainConfig.clip_groups: pattern(s) {unused} match no parameter; "
                f"names look like {list(param_names)[:4]}"
            )

    def sumsq(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """Per-group sums of squared gradient entries, float64 (G,), from the pieces this rank holds."""
        out = torch.zeros(len(self.group_names), dtype=torch.float64)
        if not named_grads:
            return out
        grads = [g for _, g in named_grads]
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        devices = {n.device for n in norms}
        if len(devices) == 1:  # one host transfer instead of one per tensor
            sq = torch.stack(norms).detach().to("cpu", torch.float64).pow(2)
        else:
            sq = torch.stack([n.detach().to("cpu", torch.float64) for n in norms]).pow(2)
        names = tuple(n for n, _ in named_grads)
        if names != self._cached_names:  # the same names come every step: build the index once
            self._cached_names = names
            self._cached_index = torch.tensor([self.index_of[n] for n in names], dtype=torch.long)
        return out.index_add_(0, self._cached_index, sq)

    def clip(
        self,
        named_grads: Sequence[tuple[str, torch.Tensor]],
        *,
        all_reduce: bool = False,
        unscale: float = 1.0,
        apply: bool = True,
    ) -> ClipReport:
        """Measure per-group norms (all-reduced across ranks when ``all_reduce``) and scale each group in place.

        ``unscale`` divides out a loss scale still present in the gradients: norms are reported unscaled and the
        factor brings the scaled gradients to the unscaled threshold.
        """
        sq = self.sumsq(named_grads)
        if all_reduce:
            sq = all_reduce_sum(sq)
        sq = sq / (unscale * unscale)
        norms = sq.sqrt().tolist()
        total = float(sq.sum().sqrt())
        factors = []
        for norm, thr in zip(norms, self.thresholds, strict=True):
            factors.append(min(1.0, thr / (norm + 1e-6)) if thr > 0 and norm == norm else 1.0)
        if apply and min(factors) < 1.0:
            by_group: dict[int, list[torch.Tensor]] = {}
            for name, g in named_grads:
                idx = self.index_of[name]
                if factors[idx] < 1.0:
                    by_group.setdefault(idx, []).append(g)
            for idx, tensors in by_group.items():
                torch._foreach_mul_(tensors, factors[idx])
        return ClipReport(
            dict(zip(self.group_names, norms, strict=True)), dict(zip(self.group_names, factors, strict=True)), total
        )


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only; norms, biases and other 1-D tensors get none.

    Example:
        >>> groups = adamw_param_groups(torch.nn.Linear(4, 4), 0.1)
        >>> [g["weight_decay"] for g in groups]
        [0.1, 0.0]
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
