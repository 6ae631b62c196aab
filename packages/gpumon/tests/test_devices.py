"""GPU discovery: CUDA_VISIBLE_DEVICES (indices and UUIDs) and the no-driver path, real and simulated."""

import sys

import pytest
from nvml_driver import driver_present

import gpumon
from gpumon.fake_nvml import FakeNVML, two_gpus

UUID0 = two_gpus()[0].uuid
UUID1 = two_gpus()[1].uuid


@pytest.fixture
def fake(monkeypatch):
    module = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.mark.parametrize(
    ("visible", "expected_nvml_indices"),
    [
        (None, [0, 1]),
        ("1", [1]),
        ("1,0", [1, 0]),
        (UUID1, [1]),
        ("GPU-9999", [1]),  # a unique UUID prefix, as CUDA accepts it
        (f"{UUID1},0", [1, 0]),
        ("0,bad,1", [0]),  # CUDA ignores everything after an entry it cannot parse
        ("0,7,1", [0]),  # ... or a device that does not exist
        ("GPU-", []),  # an ambiguous prefix matches nothing
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_selects_and_orders_gpus(fake, monkeypatch, visible, expected_nvml_indices):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = gpumon.devices()
    assert [d["nvml_index"] for d in found] == expected_nvml_indices
    assert [d["index"] for d in found] == list(range(len(expected_nvml_indices)))  # CUDA renumbers from 0
    assert fake.init_count == 0


def test_monitor_names_columns_by_cuda_ordinal(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUID1)
    with gpumon.Monitor(rate_hz=50, out=tmp_path / "g.csv", backend="nvml") as mon:
        pass
    assert {c.split(".")[0] for c in mon.columns} == {"gpu0"}
    assert mon.devices[0]["uuid"] == UUID1 and mon.devices[0]["nvml_index"] == 1


def test_fake_without_driver_raises_one_line_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=False))
    with pytest.raises(gpumon.NVMLUnavailable) as info:
        gpumon.devices()
    assert "\n" not in str(info.value) and "Library Not Found" in str(info.value)


def test_real_binding_without_driver_raises_nvml_unavailable():
    if driver_present():
        pytest.skip("an NVIDIA driver is present: the no-driver path cannot be exercised here")
    with pytest.raises(gpumon.NVMLUnavailable) as info:
        gpumon.devices()
    assert "\n" not in str(info.value) and "driver" in str(info.value)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.gpu
def test_real_driver_lists_gpus():
    found = gpumon.devices()
    assert found and all(d["memory_total"] > 0 and d["name"] for d in found)
