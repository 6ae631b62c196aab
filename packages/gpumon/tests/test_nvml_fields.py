"""Power and energy through NVML field values: one call per tick, stand-ins where the driver lacks a field.

The fake's nvmlDeviceGetFieldValues is checked against nvidia-ml-py's own structures first, so that what the
backend is tested against has the binding's shape.
"""

import ctypes
import importlib
import sys
import time

import pytest

from gpumon.fake_nvml import FakeGPU, FakeNVML, c_nvmlFieldValue_t, c_nvmlValue_t, two_gpus
from gpumon.nvml_backend import NVMLBackend
from gpumon.nvml_fields import decode_field
from gpumon.recording import Recording
from gpumon.sampler import Sampler


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def install(monkeypatch, *gpus, clock=None):
    fake = FakeNVML(list(gpus) or None, clock=clock or time.monotonic)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def gpu(**kwargs):
    return FakeGPU("Fake GPU", "GPU-00000000-1111-2222-3333-444444444444", **kwargs)


def test_fake_field_value_structures_match_nvidia_ml_py():
    real = importlib.import_module("pynvml")  # nvidia-ml-py, a dependency: importable without a driver
    assert not isinstance(real, FakeNVML)
    for ours, theirs in ((c_nvmlFieldValue_t, real.c_nvmlFieldValue_t), (c_nvmlValue_t, real.c_nvmlValue_t)):
        assert [(n, ctypes.sizeof(t)) for n, t in ours._fields_] == [(n, ctypes.sizeof(t)) for n, t in theirs._fields_]
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
    for name in ("NVML_FI_DEV_POWER_INSTANT", "NVML_FI_DEV_POWER_AVERAGE", "NVML_FI_DEV_ENERGY",
                 "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "NVML_VALUE_TYPE_UNSIGNED_SHORT",
                 "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):  # fmt: skip
        assert getattr(FakeNVML(), name) == getattr(real, name), name


def test_fake_field_values_echo_the_request_with_a_status_per_field(monkeypatch):
    fake = install(monkeypatch)
    fake.nvmlInit()
    before = time.time() * 1e6
    values = fake.nvmlDeviceGetFieldValues(0, [186, (191, 1), 83, 999])
    assert [(v.fieldId, v.scopeId) for v in values] == [(186, 0), (191, 1), (83, 0), (999, 0)]
    assert [v.nvmlReturn for v in values] == [0, 0, 0, fake.NVML_ERROR_NOT_SUPPORTED]
    assert values[0].valueType == fake.NVML_VALUE_TYPE_UNSIGNED_INT and values[0].value.uiVal == 250_000
    assert values[1].value.ullVal == values[2].value.ullVal  # fields 191 and 83 are the same counter
    assert before - 1e6 <= values[0].timestamp <= time.time() * 1e6 + 1e6  # microseconds since 1970
    fake.nvmlShutdown()


@pytest.mark.parametrize(("member", "expected"), [("siVal", 250_000), ("dVal", 250_000.0), ("ullVal", 250_000)])
def test_every_value_type_drivers_report_is_decoded(monkeypatch, member, expected):
    install(monkeypatch, gpu(value_members={186: member}))
    backend = NVMLBackend()
    value = backend.pollers[1].read()[0]  # gpu0.power, instant
    assert value == expected and type(value) is type(expected)
    backend.close()


def test_all_three_readings_cost_one_call_per_tick(monkeypatch):
    # A clock that stands still: the simulated power and energy depend only on it, not on how long the test takes.
    fake = install(monkeypatch, gpu(), clock=ManualClock())
    backend = NVMLBackend()
    (power,) = [p for p in backend.pollers if p.name == "gpu0.power"]
    assert backend.device_info[0]["sources"] == {
        "gpu0.power_instant_mw": "field 186",
        "gpu0.power_average_mw": "field 185",
        "gpu0.energy_mj": "field 191",
    }
    calls = fake.calls
    assert power.read() == [250_000, 250_000, 0]
    assert fake.calls - calls == 1
    backend.close()


@pytest.mark.parametrize(
    ("fake_gpu", "sources", "dropped", "calls"),
    [
        # a driver that predates fields 185, 186 and 191 on an Ampere consumer card: GetPowerUsage is the 1 s average
        (
            gpu(unknown_fields={185, 186, 191}, compute_capability=(8, 6)),
            ("field 186", "nvmlDeviceGetPowerUsage", "field 83"),
            ["gpu0.power_instant_mw"],
            2,  # field values for energy, GetPowerUsage
        ),
        # the same on GA100 (8.0) and older: GetPowerUsage is instantaneous
        (
            gpu(unknown_fields={185, 186, 191}, compute_capability=(8, 0)),
            ("nvmlDeviceGetPowerUsage", "field 185", "field 83"),
            ["gpu0.power_average_mw"],
            2,
        ),
        # no field-values entry point at all
        (
            gpu(field_values=False),
            ("field 186", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption"),
            ["gpu0.power_instant_mw"],
            2,  # the two stand-ins; the field-values call is no longer made once its only field is dropped
        ),
        # a card without power readings: nothing stands in, every column is dropped after one failure
        (
            gpu(unsupported={"power_instant", "power_average", "energy"}),
            ("field 186", "field 185", "field 191"),
            ["gpu0.power_instant_mw", "gpu0.power_average_mw", "gpu0.energy_mj"],
            0,
        ),
    ],
)
def test_a_missing_field_falls_back_to_its_own_call(monkeypatch, tmp_path, fake_gpu, sources, dropped, calls):
    clock = ManualClock()
    fake = install(monkeypatch, fake_gpu, clock=clock)
    backend = NVMLBackend()
    columns = ["gpu0.power_instant_mw", "gpu0.power_average_mw", "gpu0.energy_mj"]
    assert tuple(backend.device_info[0]["sources"][c] for c in columns) == sources
    meta = {"devices": backend.device_info}  # what Monitor puts into the header
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "g.csv", meta=meta, clock=clock)
    for k in range(101):
        clock.now = k / 100
        sampler.sample_once(clock.now)
    (power,) = [p for p in backend.pollers if p.name == "gpu0.power"]
    before = fake.calls
    power.read()
    per_tick = fake.calls - before
    sampler.stop()
    backend.close()
    summary = sampler.summary()
    assert sorted(summary.unsupported) == sorted(dropped)
    for column in set(columns) - set(dropped):
        assert summary.metrics[column]["reads"] == 101 and summary.metrics[column]["errors"] == 0
    if "gpu0.energy_mj" not in dropped:
        assert summary.energy_j["gpu0"] == pytest.approx(300.0)  # 300 W for 1 s, whichever source
    assert per_tick == calls
    assert Recording(tmp_path / "g.csv").meta["devices"][0]["sources"]["gpu0.power_average_mw"] == sources[1]


def test_a_field_that_fails_later_is_dropped_without_losing_the_others(monkeypatch):
    clock = ManualClock()
    fake = install(monkeypatch, *two_gpus(), clock=clock)
    backend = NVMLBackend()
    sampler = Sampler(backend.pollers, rate_hz=100, clock=clock)
    sampler.sample_once(0.0)
    fake.gpus[0].unsupported.add("power_average")  # e.g. a driver that stops reporting it
    for k in range(1, 10):
        clock.now = k / 100
        sampler.sample_once(clock.now)
    backend.close()
    summary = sampler.summary()
    assert summary.unsupported == ["gpu0.power_average_mw"]
    assert summary.errors == {"gpu0.power_average_mw: Not Supported": 1}
    assert summary.metrics["gpu0.power_instant_mw"]["reads"] == 10


def test_decode_reports_the_status_as_the_matching_error(monkeypatch):
    fake = install(monkeypatch)
    fv = c_nvmlFieldValue_t()
    fv.nvmlReturn = fake.NVML_ERROR_INVALID_ARGUMENT
    assert isinstance(decode_field(fake, fv), fake.NVMLError_InvalidArgument)
    fv.nvmlReturn, fv.valueType, fv.value.usVal = 0, fake.NVML_VALUE_TYPE_UNSIGNED_SHORT, 700
    assert decode_field(fake, fv) == 700
