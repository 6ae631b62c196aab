"""The NVML backend and the sampler against the fake `pynvml` (this machine has no NVIDIA driver).

The sampler is driven tick by tick on a manual clock shared with the fake, so every expectation below is exact.
"""

import sys
from types import SimpleNamespace

import pytest

import gpumon
from gpumon.fake_nvml import FakeNVML, two_gpus
from gpumon.nvml_backend import NVMLBackend
from gpumon.nvml_fields import decode_field
from gpumon.recording import Recording
from gpumon.reports import summarize_recording
from gpumon.sampler import Sampler


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return ManualClock()


def install(monkeypatch, clock, **second_gpu):
    fake = FakeNVML(two_gpus(**second_gpu), clock=clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def run_ticks(sampler, clock, n, period=0.01):
    for k in range(n):
        clock.now = k * period
        sampler.sample_once(clock.now)


def column(rec, name):
    i = rec.columns.index(name)
    return [cells[i] for _, kind, _, _, cells in rec.rows() if kind == "s"]


def test_each_metric_group_is_polled_at_its_own_period(monkeypatch, clock, tmp_path):
    fake = install(monkeypatch, clock)
    backend = NVMLBackend()
    periods = {p.name: p.period_s for p in backend.pollers}
    assert periods["gpu0.memory"] == 0.0 and periods["gpu0.processes"] == 1.0 and periods["gpu0.pcie"] == 1.0
    assert periods["gpu0.power"] == 0.0 and periods["gpu0.clocks"] == 0.0 and periods["gpu0.temperature"] == 0.1
    # the utilisation window comes from the spacing of the (fake) driver's own samples
    assert periods["gpu0.utilization"] == pytest.approx(1 / 6, abs=1e-6)
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "g.csv", clock=clock)
    run_ticks(sampler, clock, 200)  # two seconds
    sampler.stop()
    backend.close()
    assert fake.init_count == 0, "NVML must be shut down as often as it was initialised"
    rec = Recording(tmp_path / "g.csv")
    polled = {c: sum(cell != "" for cell in column(rec, c)) for c in rec.columns}
    assert polled["gpu0.memory_used_bytes"] == 200  # every tick
    assert polled["gpu0.processes"] == 2  # 1 Hz over 2 s
    assert polled["gpu0.pcie_tx_kbps"] == 2
    assert polled["gpu0.util_gpu_pct"] == 12  # every 1/6 s over 2 s
    assert polled["gpu0.temperature_c"] == 20  # 10 Hz
    # the slow pollers of the two GPUs do not land on the same tick
    first = [
        column(rec, c).index(next(x for x in column(rec, c) if x))
        for c in ("gpu0.processes", "gpu1.processes", "gpu0.pcie_tx_kbps", "gpu1.pcie_tx_kbps")
    ]
    assert len(set(first)) == 4


def test_repeated_values_are_marked_stale(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock)
    backend = NVMLBackend()
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "g.csv", clock=clock)
    run_ticks(sampler, clock, 100)
    sampler.stop()
    backend.close()
    rec = Recording(tmp_path / "g.csv")
    temperature = column(rec, "gpu0.temperature_c")  # read at 10 Hz; the fake refreshes it once a second
    read = [c for c in temperature if c != ""]
    assert len(read) == 10 and read[0].isdigit() and set(read[1:]) == {"="}
    memory = column(rec, "gpu0.memory_used_bytes")  # refreshed every 5 ms: new at every 10 ms tick
    assert "=" not in memory
    clocks = column(rec, "gpu0.sm_clock_mhz")  # refreshed every 100 ms
    assert sum(c != "=" for c in clocks) == 10
    summary = summarize_recording(tmp_path / "g.csv")
    assert summary.metrics["gpu0.temperature_c"]["fresh_fraction"] == pytest.approx(0.1)
    assert summary.metrics["gpu0.sm_clock_mhz"]["fresh_fraction"] == pytest.approx(0.10)
    assert summary.metrics["gpu0.memory_used_bytes"]["fresh_fraction"] == 1.0


def test_energy_comes_from_counter_differences(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock)
    backend = NVMLBackend()
    sampler = Sampler(backend.pollers, rate_hz=100, clock=clock)
    run_ticks(sampler, clock, 101)  # t = 0 .. 1.00 s
    backend.close()
    # the fake's counter gains 300 W * 1000 mJ/J per second, in steps of 10 ms
    assert sampler.summary().energy_j["gpu0"] == pytest.approx(300.0)


def test_unsupported_fields_are_dropped_and_the_rest_goes_on(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, unsupported={"power_instant", "pcie", "temperature"})
    backend = NVMLBackend()
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "g.csv", clock=clock)
    run_ticks(sampler, clock, 150)
    sampler.stop()
    backend.close()
    live = sampler.summary()
    assert set(live.unsupported) == {
        "gpu1.power_instant_mw",
        "gpu1.pcie_tx_kbps",
        "gpu1.pcie_rx_kbps",
        "gpu1.temperature_c",
    }
    # each unsupported metric fails once and is then no longer asked for
    assert live.errors["gpu1.power_instant_mw: Not Supported"] == 1
    assert live.errors["gpu1.temperature_c: Not Supported"] == 1
    rec = Recording(tmp_path / "g.csv")
    instant = column(rec, "gpu1.power_instant_mw")
    assert instant[0] == "!" and set(instant[1:]) == {""}
    # the other fields of the same NVML call are still read on GPU 1, and GPU 0 is untouched
    assert all(c != "" for c in column(rec, "gpu1.power_average_mw"))
    assert all(c != "" for c in column(rec, "gpu0.power_instant_mw"))
    assert summarize_recording(tmp_path / "g.csv").unsupported == live.unsupported


def test_a_gpu_lost_mid_run_stops_only_that_gpu(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, lost_at=0.5)
    backend = NVMLBackend()
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "g.csv", clock=clock)
    run_ticks(sampler, clock, 100)
    sampler.stop()
    backend.close()
    summary = sampler.summary()
    assert summary.lost == ["gpu1"]
    assert summary.samples == 100
    assert summary.metrics["gpu0.memory_used_bytes"]["reads"] == 100
    assert summary.metrics["gpu1.memory_used_bytes"]["reads"] == 50  # t = 0.00 .. 0.49
    assert sum(n for key, n in summary.errors.items() if "GPU is lost" in key) == 1
    rec = Recording(tmp_path / "g.csv")
    gpu1 = column(rec, "gpu1.memory_used_bytes")
    assert gpu1[50] == "!" and set(gpu1[51:]) == {""}
    from_file = summarize_recording(tmp_path / "g.csv")
    assert from_file.lost == ["gpu1"] and from_file.metrics["gpu1.memory_used_bytes"]["reads"] == 50
    assert "lost during the run: gpu1" in str(from_file)


def test_a_poller_bug_is_counted_not_raised(monkeypatch, clock):
    fake = install(monkeypatch, clock)
    backend = NVMLBackend(periods={"temperature": 0.0})  # every tick, so that each tick retries

    def broken(handle, sensor):
        raise ZeroDivisionError("simulated bug")

    fake.nvmlDeviceGetTemperature = broken
    sampler = Sampler(backend.pollers, rate_hz=100, clock=clock)
    run_ticks(sampler, clock, 10)
    backend.close()
    summary = sampler.summary()
    assert summary.errors["gpu0.temperature_c: simulated bug"] == 10  # retried: not a known-permanent failure
    assert summary.metrics["gpu0.memory_used_bytes"]["reads"] == 10


def test_field_status_and_value_types_are_decoded(monkeypatch, clock):
    fake = install(monkeypatch, clock)
    backend = NVMLBackend()
    assert backend.pollers[1].read() == [250_000, 250_000, 0]  # gpu0.power: instant, average, energy
    value = SimpleNamespace(dVal=12.5, uiVal=7, ullVal=2**40, sllVal=-3, siVal=-4, ulVal=5)

    def decode(fv):
        return decode_field(fake, fv)

    assert decode(SimpleNamespace(nvmlReturn=0, valueType=fake.NVML_VALUE_TYPE_DOUBLE, value=value)) == 12.5
    assert (
        decode(SimpleNamespace(nvmlReturn=0, valueType=fake.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, value=value)) == 2**40
    )
    assert decode(SimpleNamespace(nvmlReturn=0, valueType=fake.NVML_VALUE_TYPE_SIGNED_INT, value=value)) == -4
    failed = decode(SimpleNamespace(nvmlReturn=fake.NVML_ERROR_NOT_SUPPORTED, valueType=0, value=value))
    assert isinstance(failed, fake.NVMLError_NotSupported) and backend.classify(failed) == "unsupported"
    backend.close()


def test_devices_lists_the_fake_gpus(monkeypatch, clock):
    install(monkeypatch, clock)
    found = gpumon.devices()
    assert [d["name"] for d in found] == ["Fake GPU 0", "Fake GPU 1"]
    assert found[0]["memory_total"] == 80 * 2**30 and found[0]["compute_capability"] == "9.0"
    assert sys.modules["pynvml"].init_count == 0


def test_rows_reach_the_disk_within_the_flush_bound_and_at_stop(tmp_path, clock):
    from gpumon.pollers import Poller
    from gpumon.sampler import FLUSH_EVERY_S

    # text with a comma and a quote goes through the fast row writer quoted as csv would quote it
    poller = Poller("p", "p", ["p.n", "p.text"], ["count", "text"], 0.0, lambda: [clock.now, 'a,"b"'])
    sampler = Sampler([poller], rate_hz=100, out=tmp_path / "g.csv", clock=clock)

    def rows_on_disk():
        return sum(1 for line in (tmp_path / "g.csv").read_text().splitlines() if line[:1].isdigit())

    run_ticks(sampler, clock, 50)  # t = 0 .. 0.49 s: still in the write buffer (that is what keeps ticks cheap)
    assert rows_on_disk() <= 1
    for k in range(50, int(FLUSH_EVERY_S * 100) + 1):
        clock.now = k * 0.01
        sampler.sample_once(clock.now)
    assert rows_on_disk() == int(FLUSH_EVERY_S * 100) + 1  # flushed once t reached the bound
    run_ticks(sampler, clock, 5)
    sampler.stop()
    assert rows_on_disk() == int(FLUSH_EVERY_S * 100) + 6
    assert column(Recording(tmp_path / "g.csv"), "p.text")[:2] == ['a,"b"', "="]
