"""The budget planner's rule (BudgetSchedule), unit by unit: no timing, only the arithmetic it promises."""

import pytest

from trainloop import BudgetSchedule, TrainConfig


def _sched(**kw):
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, time_budget_s=100.0, **kw)
    return BudgetSchedule(cfg)


def test_warmup_then_constant_until_the_first_replan():
    s = _sched()
    assert s.lr(0) == pytest.approx(1e-4) and s.lr(5) == pytest.approx(5.5e-4)
    assert s.lr(10) == s.lr(10**6) == 1e-3  # no decay planned yet
    assert s.observe(500, 19.9) is None  # before 20% of the budget nothing changes
    assert s.decay_start is None and s.max_steps == 10**9


def test_replan_sizes_the_run_to_the_remaining_budget():
    s = _sched()
    msg = s.observe(200, 20.0)  # 10 steps/s, 80 s left, planned at 92% of the speed
    assert s.max_steps == 200 + int(10 * 80 * 0.92) == 936
    assert s.decay_start == 936 - int(0.4 * 936) == 562
    assert "936 steps" in msg and "decay from step 562" in msg
    assert s.lr(561) == 1e-3 and s.lr(936) == pytest.approx(1e-4)
    assert s.lr(749) == pytest.approx(1e-3 + (1e-4 - 1e-3) * (749 - 562) / (936 - 562))
    # The second re-plan (55%) measures the speed since the first one (here slower) and moves the end.
    assert s.observe(500, 54.0) is None
    s.observe(500, 56.0)  # 300 steps in 36 s, 44 s left
    assert s.max_steps == 500 + int(300 / 36 * 44 * 0.92) == 837
    assert s.decay_start == 837 - int(0.4 * 837)
    assert s.observe(800, 90.0) is None  # only two re-plans (20% and 55%)
    assert [p["at_step"] for p in s.plans] == [200, 500]


def test_a_replan_inside_the_decay_continues_from_the_current_rate():
    s = BudgetSchedule(TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, time_budget_s=100.0), replan_at=(0.2, 0.9))
    s.observe(100, 20.0)  # 5 steps/s -> 100 + 368 = 468 steps, decay from 281
    before = s.lr(400)
    s.observe(400, 90.0)  # slower: 300 steps in 70 s, 10 s left
    assert s.decay_start == 400 and s.lr(400) == pytest.approx(before)  # continuous at the re-plan
    assert s.lr(s.max_steps) == 0.0 and s.lr(s.max_steps - 1) > 0.0


def test_warmup_longer_than_the_budget_allows_still_ends():
    s = _sched()
    s.observe(1, 20.0)  # 0.05 steps/s: fewer steps than the warmup
    assert s.max_steps == 11 and s.decay_start == 10  # warmup, then one step of decay
    assert s.lr(11) == pytest.approx(1e-4)


def test_state_round_trip_and_kind_check():
    s = _sched()
    s.observe(200, 20.0)
    t = _sched()
    t.load_state_dict(s.state_dict())
    assert [t.lr(i) for i in range(0, 1000, 37)] == [s.lr(i) for i in range(0, 1000, 37)]
    assert t.observe(700, 56.0) == s.observe(700, 56.0) is not None
    with pytest.raises(ValueError, match="kind 'config'"):
        t.load_state_dict({"kind": "config"})


@pytest.mark.parametrize("replan_at", [(0.5, 0.2), (0.0, 0.5), (0.5, 1.0), (0.3, 0.3)])
def test_bad_replan_points(replan_at):
    with pytest.raises(ValueError, match="replan_at"):
        BudgetSchedule(TrainConfig(time_budget_s=10.0), replan_at=replan_at)


def test_needs_a_budget():
    with pytest.raises(ValueError, match="time_budget_s"):
        BudgetSchedule(TrainConfig())
