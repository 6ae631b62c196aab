"""Summary statistics against values computed by hand."""

import math

import pytest

from gpumon.sampler import next_tick_index
from gpumon.statistics import MetricStats, Reservoir, SummaryBuilder, percentile


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    # rank (4 - 1) * 0.95 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert math.isnan(percentile([], 50))


def test_time_weighted_mean_holds_each_reading_until_the_next():
    m = MetricStats("W")
    for t, v in [(0.0, 1.0), (1.0, 3.0), (3.0, 5.0)]:
        m.add(t, v, fresh=True)
    d = m.as_dict()
    # 1 for one second, 3 for two seconds: (1*1 + 3*2) / 3; the last reading has no duration yet
    assert d["mean"] == pytest.approx(7.0 / 3.0)
    assert d["peak"] == 5.0 and d["peak_t"] == 3.0 and d["min"] == 1.0
    assert d["p50"] == 3.0


def test_fresh_fraction_counts_only_changed_readings():
    m = MetricStats("C")
    for i, (v, fresh) in enumerate([(40, True), (40, False), (40, False), (41, True)]):
        m.add(i * 0.01, v, fresh)
    assert m.as_dict()["fresh_fraction"] == 0.5


def test_counter_increase_survives_a_reset():
    m = MetricStats("mJ", counter=True)
    for t, v in [(0, 1000), (1, 1500), (2, 2500), (3, 200), (4, 700)]:
        m.add(t, v, True)
    # +500 +1000, then the counter restarted at 0 and reached 200 (+200), then +500
    assert m.as_dict()["increase"] == 2200


def test_reservoir_is_bounded_and_exact_below_capacity():
    r = Reservoir(capacity=100)
    for i in range(100):
        r.add(float(i))
    assert r.exact and r.percentiles((50,)) == [49.5]
    for i in range(100, 10_000):
        r.add(float(i))
    assert len(r.values) == 100 and not r.exact and r.seen == 10_000
    # a uniform sample of 0..9999: its median lies near 5000, far from the first 100 values
    assert 2500 < r.percentiles((50,))[0] < 7500


def test_builder_rates_missed_ticks_and_interval_errors():
    b = SummaryBuilder(
        rate_hz=100.0, units={"gpu0.energy_mj": "mJ", "gpu0.power_instant_mw": "mW"}, counters={"gpu0.energy_mj"}
    )
    times = [0.00, 0.01, 0.02, 0.05, 0.06]  # two deadlines missed between 0.02 and 0.05
    for i, t in enumerate(times):
        b.add_tick(t)
        b.metrics["gpu0.energy_mj"].add(t, 1000 * i, True)
        b.metrics["gpu0.power_instant_mw"].add(t, 100_000.0, True)
    b.add_error("gpu1.memory_used_bytes", "GPU is lost", "lost")
    b.add_error("gpu0.pcie_tx_kbps", "Not Supported", "unsupported")
    s = b.finish(busy_s=0.0005, cpu_s=0.0003)
    assert s.samples == 5 and s.duration_s == pytest.approx(0.06)
    assert s.achieved_rate_hz == pytest.approx(4 / 0.06)
    assert s.missed_ticks == 2
    # interval errors |gap - 10 ms|: 0, 0, 20 ms, 0 -> p99 at rank 2.97 of the sorted four: 0 + 0.97 * 20 ms
    assert s.interval_error_p99_ms == pytest.approx(0.97 * 20.0)
    assert s.energy_j == {"gpu0": pytest.approx(4.0)}  # the counter rose by 4000 mJ
    assert s.energy_from_power_j == {"gpu0": pytest.approx(100.0 * 0.06)}  # 100 W held for 0.06 s
    assert s.sampler_us_per_sample == pytest.approx(100.0)  # 0.5 ms over 5 ticks
    assert s.sampler_cpu_percent == pytest.approx(0.5)  # 0.3 ms of CPU in 60 ms
    assert s.lost == ["gpu1"] and s.unsupported == ["gpu0.pcie_tx_kbps"]
    assert s.errors == {"gpu1.memory_used_bytes: GPU is lost": 1, "gpu0.pcie_tx_kbps: Not Supported": 1}
    text = str(s)
    assert "lost during the run: gpu1" in text and "4.0 J from the energy counter" in text


@pytest.mark.parametrize(
    ("k", "elapsed", "expected"),
    [
        (0, 0.0005, 1),  # on time: the next deadline
        (3, 0.0395, 4),  # finished just before deadline 4: still 4
        (3, 0.0715, 7),  # 3 periods late: deadlines 4..6 skipped, 7 (due at 0.07) runs at once
    ],
)
def test_next_tick_stays_on_the_absolute_grid(k, elapsed, expected):
    assert next_tick_index(k, elapsed, 0.01) == expected


def test_runs_of_equal_values_enter_the_reservoir_as_if_added_one_by_one():
    one_by_one, runs = Reservoir(capacity=1000), Reservoir(capacity=1000)
    for v, count in [(1.0, 300), (2.0, 200)]:
        for _ in range(count):
            one_by_one.add(v)
        runs.add_many(v, count)
    assert list(runs.values) == list(one_by_one.values) and runs.seen == 500 and runs.exact
    # past capacity the sample stays uniform: half the values were 3.0, so about half the sample is
    full = Reservoir(capacity=200)
    full.add_many(3.0, 20_000)
    full.add_many(4.0, 20_000)
    share = sum(v == 4.0 for v in full.values) / 200
    assert len(full.values) == 200 and full.seen == 40_000 and not full.exact
    assert 0.35 < share < 0.65  # binomial(200, 0.5): 4.2 standard deviations either side


def test_stale_readings_weigh_in_the_percentiles_as_readings():
    m = MetricStats("W")
    m.add(0.0, 1.0, True)
    for k in range(1, 4):  # read again, unchanged, three times
        m.add_stale(k * 0.01, 1.0)
    m.add(0.04, 5.0, True)
    m.add_stale(0.05, 5.0)
    d = m.as_dict()
    assert d["reads"] == 6 and d["p50"] == 1.0 and d["p95"] == pytest.approx(5.0)
    assert m.reservoir.seen == 6
