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


def test_a_small_file_seen_many_times_gets_the_regularisation_of_the_top_row():
    small = 330_000  # WikiText-2's validation split minus held-out text, at the default vocabulary
    model_cfg, train_cfg, note = plan_regularisation(small, BUDGET_TOKENS, *configs())
    _, dropout, weight_decay = RULE[-1]
    assert training_passes(small, BUDGET_TOKENS) >= RULE[-1][0]
    assert (model_cfg.dropout, train_cfg.weight_decay) == (dropout, weight_decay)
    assert "8.7 passes" in note and f"dropout {dropout:g}" in note


def test_a_large_file_seen_once_keeps_the_preset():
    large = 200 * BUDGET_TOKENS  # the budget covers half a percent of it
    model_cfg, train_cfg, note = plan_regularisation(large, BUDGET_TOKENS, *configs())
    assert (model_cfg, train_cfg) == configs()
    assert "settings kept" in note


def test_the_rule_is_monotonic_and_starts_at_no_dropout():
    assert RULE[0][:2] == (0.0, 0.0)
    assert [row[0] for row in RULE] == sorted(row[0] for row in RULE)
    assert [row[1] for row in RULE] == sorted(row[1] for row in RULE)


@pytest.mark.parametrize("passes", [row[0] for row in RULE])
def test_each_row_applies_from_its_threshold(passes):
    train_tokens = 100_000
    model_cfg, _, _ = plan_regularisation(train_tokens, passes * train_tokens, *configs())
    assert model_cfg.dropout == [row for row in RULE if row[0] == passes][0][1]


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
