"""trainloop.evaluate: the token-weighted mean loss and the standard error from the spread of batch losses."""

import math

import pytest
import torch

from trainloop.evaluation import evaluate


def _split(losses, rows=4):
    """Batches whose forward returns the given losses (each batch of `rows` targets)."""
    return lambda: [(torch.full((rows, 1), v), torch.zeros(rows, 1)) for v in losses]


def _loss(inputs, targets):
    return inputs.mean()


def test_standard_error_is_the_spread_of_the_batch_losses():
    losses = [2.0, 3.0, 4.0, 5.0]
    result = evaluate(_loss, torch.nn.Linear(1, 1), _split(losses))
    assert result["loss"] == pytest.approx(3.5) and result["tokens"] == 16
    sd = math.sqrt(sum((x - 3.5) ** 2 for x in losses) / 3)
    assert result["loss_se"] == pytest.approx(sd / 2)


def test_equal_batches_have_no_spread_and_one_batch_no_estimate():
    assert evaluate(_loss, torch.nn.Linear(1, 1), _split([1.5] * 3))["loss_se"] == pytest.approx(0.0, abs=1e-12)
    assert "loss_se" not in evaluate(_loss, torch.nn.Linear(1, 1), _split([1.5]))
