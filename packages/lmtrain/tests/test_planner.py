"""The time-budget plan: regularisation chosen from the passes over the data (what it picks for a small and a large
token file), early stopping on by default. No timing: the budget's tokens are given."""

import pytest

from lmcore import ModelConfig
from lmtrain.planner import RULE, plan_regularisation, training_passes
from trainloop import BUDGET, TrainConfig

TOKENS_PER_STEP = 16 * 128  # the cpu-small recipe: micro_batch 16 x seq_len 128, one rank, no accumulation
BUDGET_TOKENS = 1400 * TOKENS_PER_STEP  # what 260 s buy on an idle 2-core machine (about 5.4 steps/s)


def configs():
    return ModelConfig.from_preset("cpu-small"), TrainConfig()


def test_a_small_file_seen_many_times_gets_dropout_and_weight_decay():
    small = 330_000  # WikiText-2's validation split minus held-out text, at the default vocabulary
    model_cfg, train_cfg, note = plan_regularisation(small, BUDGET_TOKENS, *configs())
    assert round(training_passes(small, BUDGET_TOKENS), 1) == 8.7
    assert (model_cfg.dropout, train_cfg.weight_decay) == (0.1, 1.0)
    assert "8.7 passes" in note and "dropout 0.1, weight decay 1" in note


def test_a_large_file_seen_once_keeps_the_preset():
    large = 200 * BUDGET_TOKENS  # the budget covers half a percent of it
    model_cfg, train_cfg, note = plan_regularisation(large, BUDGET_TOKENS, *configs())
    assert (model_cfg, train_cfg) == configs()
    assert "settings kept" in note


def test_the_rule_is_monotonic_and_starts_at_no_dropout():
    assert RULE[0][:2] == (0.0, 0.0)
    assert [row[0] for row in RULE] == sorted(row[0] for row in RULE)
    assert [row[1] for row in RULE] == sorted(row[1] for row in RULE)


# The values docs/benchmarks.md and the README state, written out: derived from RULE, a changed rule would pass.
MEASURED_RULE = {1.0: (0.0, 0.1), 5.99: (0.0, 0.1), 6.0: (0.1, 1.0), 8.7: (0.1, 1.0), 30.0: (0.1, 1.0)}


@pytest.mark.parametrize("fault", [None, "threshold_moved", "dropout_changed"])
def test_the_rule_applies_the_measured_settings_from_six_passes(monkeypatch, fault):
    if fault == "threshold_moved":
        monkeypatch.setattr("lmtrain.planner.RULE", ((0.0, 0.0, 0.1), (5.0, 0.1, 1.0)))
    elif fault == "dropout_changed":
        monkeypatch.setattr("lmtrain.planner.RULE", ((0.0, 0.0, 0.1), (6.0, 0.2, 1.0)))
    train_tokens = 100_000
    planned = {}
    for passes in MEASURED_RULE:
        model_cfg, train_cfg, _ = plan_regularisation(train_tokens, passes * train_tokens, *configs())
        planned[passes] = (model_cfg.dropout, train_cfg.weight_decay)
    if fault is None:
        assert planned == MEASURED_RULE
    else:
        assert planned != MEASURED_RULE  # what the equality above catches


def test_values_the_user_set_are_kept():
    model_cfg, train_cfg = ModelConfig.from_preset("cpu-small", dropout=0.05), TrainConfig(weight_decay=0.0)
    planned = plan_regularisation(10_000, BUDGET_TOKENS, model_cfg, train_cfg, keep={"dropout", "weight_decay"})
    assert planned[:2] == (model_cfg, train_cfg)


@pytest.mark.parametrize(("tokens", "budget"), [(0, 1.0), (1.5, 1.0), (10, -1.0), (10, float("nan"))])
def test_bad_sizes_name_the_value(tokens, budget):
    with pytest.raises(ValueError, match="must be"):
        training_passes(tokens, budget)


def test_a_budgeted_run_stops_early_unless_the_user_set_the_patience():
    cfg, _ = BUDGET.configure(TrainConfig(), 260.0, 0.2)
    assert cfg.early_stopping_patience == BUDGET.patience and cfg.keep_best and cfg.eval_every_s == 260.0 / 12
    cfg, _ = BUDGET.configure(TrainConfig(early_stopping_patience=0), 260.0, 0.2, keep={"early_stopping_patience"})
    assert cfg.early_stopping_patience == 0
