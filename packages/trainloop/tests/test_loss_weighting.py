"""The loss of a step weighs every scored target alike: micro-batches (and ranks) holding very different numbers of
targets give the gradient of their concatenation's mean loss, not the mean of their means."""

import pytest
import torch
from launch import run, tagged
from tiny_model import BlocksLM

IGNORE = -100


def _batches():
    """Four micro-batches of 2 x 8 tokens: 1, 16, 3 and 12 scored targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for scored in (1, 16, 3, 12):
        inputs = torch.randint(0, 32, (2, 8), generator=g)
        targets = torch.randint(0, 32, (2, 8), generator=g)
        targets.view(-1)[scored:] = IGNORE
        out.append((inputs, targets))
    return out


def _reference(batches):
    """The gradient of the mean loss over every scored target of the concatenated batches."""
    torch.manual_seed(0)
    model = BlocksLM()
    inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    model(inputs, targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _check(grads, batches):
    reference = _reference(batches)
    assert set(grads) == set(reference), (sorted(grads), sorted(reference))
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(g), reference[name], rtol=1e-6, atol=1e-6, msg=name)


def _as_json(batches):
    return [[x.tolist(), y.tolist()] for x, y in batches]


def test_micro_batches_of_uneven_targets_give_the_concatenated_batchs_gradient(tmp_path):
    batches = _batches()
    proc = run("weighting.py", {"run_dir": str(tmp_path / "run"), "batches": [_as_json(batches)]})
    _check(tagged(proc, "GRADS"), batches)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "fsdp", "deepspeed"])
def test_ranks_of_uneven_targets_give_the_concatenated_batchs_gradient(tmp_path, engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    batches = _batches()
    # Rank 0 holds micro-batches of 1 and 16 targets, rank 1 of 3 and 12: the global batch is all four.
    proc = run("weighting.py", {"run_dir": str(tmp_path / "run"), "engine": engine,
                                "batches": [_as_json(batches[:2]), _as_json(batches[2:])]}, nproc=2)  # fmt: skip
    _check(tagged(proc, "GRADS"), batches)
