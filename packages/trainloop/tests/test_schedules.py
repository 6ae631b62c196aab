import math

import pytest

from trainloop import TrainConfig, lr_at


def test_reference_recipe_schedule_matches_closed_form():
    cfg = TrainConfig(lr=3e-4, min_lr=1e-6, warmup_steps=500, t_max=10_000, max_steps=12_000)
    for step in (0, 1, 250, 499):
        assert lr_at(step, cfg) == pytest.approx(1e-6 + (3e-4 - 1e-6) * step / 500, rel=1e-12)
    for step in (500, 501, 2000, 5250, 9999):
        p = (step - 500) / 9500
        assert lr_at(step, cfg) == pytest.approx(1e-6 + (3e-4 - 1e-6) * (1 + math.cos(math.pi * p)) / 2, rel=1e-12)
    assert lr_at(500, cfg) == pytest.approx(3e-4)
    assert lr_at(5250, cfg) == pytest.approx((3e-4 + 1e-6) / 2)  # halfway down the cosine
    assert lr_at(10_000, cfg) == lr_at(11_999, cfg) == 1e-6


def test_constant_and_wsd():
    const = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="constant", max_steps=100)
    assert lr_at(5, const) == pytest.approx(5e-4) and lr_at(10, const) == lr_at(99, const) == 1e-3
    wsd = TrainConfig(lr=1e-3, min_lr=1e-5, warmup_steps=10, schedule="wsd", max_steps=100, wsd_decay_steps=20)
    assert lr_at(10, wsd) == lr_at(79, wsd) == 1e-3
    assert lr_at(80, wsd) == 1e-3 and lr_at(90, wsd) == pytest.approx((1e-3 + 1e-5) / 2)
    assert lr_at(100, wsd) == 1e-5
    default_decay = TrainConfig(lr=1e-3, min_lr=0.0, schedule="wsd", max_steps=100)  # last 10% decays
    assert lr_at(89, default_decay) == 1e-3 and lr_at(95, default_decay) == pytest.approx(5e-4)
