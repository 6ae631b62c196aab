"""Evaluation: eval mode under no_grad, train mode restored; mean token loss, perplexity, bits per byte."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from trainloop.distributed import all_reduce_sum


def evaluate(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    module: torch.nn.Module,
    eval_data: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    *,
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    bytes_per_token: float | None = None,
    stop: Callable[[], bool] | None = None,
    collective: bool = False,
) -> dict[str, float] | None:
    """Mean loss over the split (or its first ``max_batches``), token perplexity ``exp(loss)`` and, given the split's
    bytes per token, bits per byte ``loss / ln 2 / bytes_per_token``.

    Batches are weighted by their count of scored targets (labels other than -100). With several ranks the sums are
    all-reduced, so ranks may evaluate different shards or the same data. With two batches or more, ``loss_se`` is
    the standard error of the loss estimated from the spread of the batches' mean losses (std / sqrt(batches)):
    how far the figure may move on another subset of the same size, the yardstick for ranking checkpoints by it
    (two checkpoints scored on the same subset differ by less noise than that).

    ``stop`` (e.g. "a signal arrived") is asked before every batch; when it says yes on any rank, every rank stops
    at the same batch and the evaluation returns None. With several ranks that agreement costs one small all-reduce
    per batch, which a rank that has run out of batches keeps joining until every rank has.

    ``collective``: ``forward`` is itself a collective (a sharded engine gathers parameters in it), so every rank
    must run it as often as the others: a rank that has run out of batches runs its last batch again, uncounted,
    while any other rank still evaluates.

    Example (a regression whose every prediction is 0.1 off: mean squared error 0.01):
        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> x = torch.randn(32, 4); y = model(x).detach() + 0.1
        >>> split = lambda: [(x[:16], y[:16]), (x[16:], y[16:])]
        >>> result = evaluate(lambda x, y: torch.nn.functional.mse_loss(model(x), y), model, split, bytes_per_token=2.0)
        >>> {k: round(v, 4) for k, v in result.items()}, model.training
        ({'loss': 0.01, 'ppl': 1.0101, 'tokens': 32.0, 'loss_se': 0.0, 'bpb': 0.0072}, True)
    """
    was_training = module.training
    module.eval()
    # sums of: loss x targets, targets, batches, batch losses, squared batch losses
    total = torch.zeros(5, dtype=torch.float64)
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    agree = several and (stop is not None or collective)
    i = 0
    last: tuple[torch.Tensor, torch.Tensor] | None = None
    try:
        batches = iter(eval_data())
        with torch.no_grad():
            while True:
                batch = next(batches, None) if max_batches is None or i < max_batches else None
                stopping = stop is not None and stop()
                if agree:  # (ranks stopping, ranks still holding a batch): the same decision on every rank
                    flags = torch.tensor([stopping, batch is not None], dtype=torch.float64)
                    stopping, active = (v > 0 for v in all_reduce_sum(flags).tolist())
                else:
                    active = batch is not None
                if stopping:
                    return None
                if not active:
                    break
                if batch is None:
                    if collective:
                        if last is None:
                            raise ValueError(
                                f"rank {dist.get_rank()} has no evaluation batch while other ranks have: a sharded "
                                "engine needs at least one batch on every rank (give eval_data more windows)"
                            )
                        forward(*last)
                    continue
                inputs, targets = batch[0].to(device), batch[1].to(device)
                last = (inputs, targets)
                loss = forward(inputs, targets)
                n = float((targets != -100).sum())
                value = float(loss)
                total += torch.tensor([value * n, n, 1.0, value, value * value], dtype=torch.float64)
                i += 1
    finally:
        module.train(was_training)
    total = all_reduce_sum(total)
    loss_sum, n, n_batches, batch_sum, batch_squares = total.tolist()
    if n == 0:
        raise ValueError("eval_data yielded no scored tokens")
    loss = loss_sum / n
    out = {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": n}
    if n_batches >= 2:
        variance = max(0.0, (batch_squares - batch_sum * batch_sum / n_batches) / (n_batches - 1))
        out["loss_se"] = math.sqrt(variance / n_batches)
    if bytes_per_token:
        out["bpb"] = loss / math.log(2) / bytes_per_token
    return out
