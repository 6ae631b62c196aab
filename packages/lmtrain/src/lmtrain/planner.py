"""Regularisation sized to how many times a run will see its training data.

A `--time-budget` run trains on as many tokens as the budget buys. When that is several times the training file,
the model memorises it: training loss keeps falling while validation loss stalls, then rises. Before training,
lmtrain times a step, estimates the passes over the training tokens the budget buys (tokens per step x budget /
seconds per step, over the training tokens; an upper bound, since the loop runs a little slower than the timed
step) and applies the last row of RULE whose threshold that reaches: dropout (lmcore `ModelConfig.dropout`:
embeddings, residual and MLP outputs; never active in eval or generate) and AdamW weight decay (matrices only).

The rule is what `tools/tune_regularisation.py` measured with `cpu-small` at a fixed number of steps, on tuning
splits only (WikiText-2: articles of its validation split outside the benchmark's report text; TinyShakespeare:
characters 85-90% of the file, outside the headline's validation split), validation loss of the best checkpoint
in nats/token (TinyShakespeare: bits/char), preset settings (dropout 0, weight decay 0.1) against dropout 0.1 with
weight decay 1.0:

    passes (WikiText-2)        1.0             2.9             5.0             8.7
    preset                     4.663           4.244           4.196           4.204
    dropout 0.1, decay 1.0     4.710 (+0.047)  4.331 (+0.087)  4.199 (+0.002)  4.063 (-0.141)

and on TinyShakespeare at 8.6 passes 2.1933 (preset) against 2.1883 bits/char. At 8.7 passes on WikiText-2 the
other settings tried were worse than dropout 0.1 with decay 1.0: dropout 0.1, 0.2, 0.3 with decay 0.1 (4.103,
4.116, 4.165), decay 0.3 and 1.0 without dropout (4.193, 4.101), dropout 0.2 with decay 1.0 (4.138), width 192
at equal computation (4.135, dropout 0.1). A few passes are not enough to overfit, and regularising them costs;
many passes are. The row starts at 6 passes, a little above the break-even point, since the estimate runs high.
docs/benchmarks.md has the whole table and the commands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

# (passes at or above which the row applies, dropout, weight decay); the last row reached applies.
RULE: tuple[tuple[float, float, float], ...] = (
    (0.0, 0.0, 0.1),  # cpu-small's recipe
    (6.0, 0.1, 1.0),  # break-even at 5 passes in the measurements above, a gain at 8.7
)


def training_passes(train_tokens: int, budget_tokens: float) -> float:
    """How many times the budget's tokens cover the training file.

    Example:
        >>> round(training_passes(329_620, 1400 * 16 * 128), 1)
        8.7
    """
    if not isinstance(train_tokens, int) or train_tokens < 1:
        raise ValueError(f"train_tokens={train_tokens!r} must be an int >= 1 (the training token file's length)")
    if not budget_tokens >= 0:
        raise ValueError(f"budget_tokens={budget_tokens!r} must be a number >= 0 (tokens the budget buys)")
    return budget_tokens / train_tokens


def plan_regularisation(
    train_tokens: int, budget_tokens: float, model_cfg: Any, train_cfg: Any, *, keep: Collection[str] = ()
) -> tuple[Any, Any, str]:
    """(ModelConfig, TrainConfig, note): dropout and weight decay for a run that will train on `budget_tokens`
    tokens of a `train_tokens`-token file. Fields named in `keep` (set by the user) are left as they are.

    Example:
        >>> from lmcore import ModelConfig
        >>> from trainloop import TrainConfig
        >>> model_cfg, train_cfg, note = plan_regularisation(329_620, 2.87e6, ModelConfig(), TrainConfig())
        >>> model_cfg.dropout, train_cfg.weight_decay
        (0.1, 1.0)
        >>> note
        'the budget buys about 8.7 passes over 329,620 training tokens: dropout 0.1, weight decay 1'
        >>> plan_regularisation(20_000_000, 80_000, ModelConfig(), TrainConfig())[2]
        'the budget buys about 0.004 of a pass over 20,000,000 training tokens: settings kept'
    """
    passes = training_passes(train_tokens, budget_tokens)
    _, dropout, weight_decay = [row for row in RULE if passes >= row[0]][-1]
    changes = []
    if "dropout" not in keep and model_cfg.dropout != dropout:
        model_cfg = dataclasses.replace(model_cfg, dropout=dropout)
        changes.append(f"dropout {dropout:g}")
    if "weight_decay" not in keep and train_cfg.weight_decay != weight_decay:
        train_cfg = dataclasses.replace(train_cfg, weight_decay=weight_decay)
        changes.append(f"weight decay {weight_decay:g}")
    what = ", ".join(changes) if changes else "settings kept"
    share = f"{passes:.1f} passes" if passes >= 0.95 else f"{passes:.2g} of a pass"  # never "about 0.0 passes"
    note = f"the budget buys about {share} over {train_tokens:,} training tokens: {what}"
    return model_cfg, train_cfg, note
