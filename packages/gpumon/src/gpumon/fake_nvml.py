"""A stand-in `pynvml` module for machines without an NVIDIA driver (tests, the benchmark, CI).

It mimics the parts of NVIDIA's binding that gpumon calls: the NVMLError hierarchy mapped from error codes,
integer units, and nvmlDeviceGetFieldValues as nvidia-ml-py has it: field ids (or (fieldId, scopeId) pairs) in,
a ctypes array of c_nvmlFieldValue_t out (fieldId, scopeId, timestamp in microseconds since 1970, latencyUsec,
valueType, a per-field nvmlReturn and the value union), an NVMLError raised only for the call as a whole. Each
simulated metric refreshes on its own period (the value changes once per period, as the driver's counters do), a
GPU can lack a metric (NotSupported) or disappear at a given time (GPU_IS_LOST from then on), and a simulated
driver can predate some field ids or the field-values entry point itself.

`simulated_gpus()` puts a FakeNVML in place of `pynvml` for the length of a `with` block; `simulated_recording()`
writes what a Monitor records of it.

Example:
    >>> import gpumon
    >>> with simulated_gpus(two_gpus(lost_at=0.0)):  # GPU 1 is lost from the start
    ...     gpumon.devices()
    Traceback (most recent call last):
    gpumon.nvml_devices.NVMLUnavailable: NVML failed while listing GPUs: GPU is lost
    >>> with simulated_gpus() as fake:  # two GPUs
    ...     [gpu["name"] for gpu in gpumon.devices()], fake.init_count
    (['Fake GPU 0', 'Fake GPU 1'], 0)
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from gpumon.monitor import Monitor

# The binding's constants (same values as nvidia-ml-py's pynvml).
CONSTANTS = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_UNKNOWN": 999,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_PCIE_UTIL_TX_BYTES": 0,
    "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_GPU_UTILIZATION_SAMPLES": 1,
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5,
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_POWER_AVERAGE": 185,
    "NVML_FI_DEV_POWER_INSTANT": 186,
    "NVML_FI_DEV_ENERGY": 191,
}
MESSAGES = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    9: "Driver Not Loaded",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    15: "GPU is lost",
    999: "Unknown Error",
}

# Seconds between changes of each simulated metric (illustrative, not a claim about real hardware).
DEFAULT_REFRESH = {
    "memory": 0.005,
    "power_instant": 0.02,
    "power_average": 1.0,
    "energy": 0.01,
    "temperature": 1.0,
    "clocks": 0.1,
    "clock_events": 0.1,
    "utilization": 1.0 / 6.0,
    "pcie": 0.02,
    "processes": 0.5,
}
POWER_W = 300.0  # the simulated draw behind the energy counter: it gains POWER_W * 1000 mJ per second


class NVMLError(Exception):
    """Like pynvml.NVMLError: constructing it with a code gives the matching subclass."""

    _by_code: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int):
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return MESSAGES.get(self.value, f"NVML error {self.value}")


def _error_class(name: str, code: int) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {"__new__": lambda c, *a: NVMLError.__new__(c, code)})
    NVMLError._by_code[code] = cls
    return cls


ERROR_CLASSES = {
    "NVMLError_Uninitialized": _error_class("Uninitialized", 1),
    "NVMLError_InvalidArgument": _error_class("InvalidArgument", 2),
    "NVMLError_NotSupported": _error_class("NotSupported", 3),
    "NVMLError_DriverNotLoaded": _error_class("DriverNotLoaded", 9),
    "NVMLError_LibraryNotFound": _error_class("LibraryNotFound", 12),
    "NVMLError_FunctionNotFound": _error_class("FunctionNotFound", 13),
    "NVMLError_GpuIsLost": _error_class("GpuIsLost", 15),
    "NVMLError_Unknown": _error_class("Unknown", 999),
}


class c_nvmlValue_t(ctypes.Union):
    """nvidia-ml-py's value union, member for member."""

    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    """nvidia-ml-py's field value structure, member for member (valueType and nvmlReturn are C enums: c_uint)."""

    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


# field id -> (simulated metric, the union member its value is written to by default)
FIELDS = {186: ("power_instant", "uiVal"), 185: ("power_average", "uiVal"), 191: ("energy", "ullVal")}
FIELDS[83] = FIELDS[191]  # NVML_FI_DEV_ENERGY is the same counter as NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
VALUE_TYPES = {"dVal": 0, "uiVal": 1, "ulVal": 2, "ullVal": 3, "sllVal": 4, "siVal": 5, "usVal": 6}


@dataclass
class FakeGPU:
    """One simulated GPU. `unsupported` names metrics from DEFAULT_REFRESH; `lost_at` is seconds after creation.

    `unknown_fields`: field ids this simulated driver predates (their status is NVML_ERROR_NOT_SUPPORTED; what a
    real driver puts there is not documented); `field_values=False`: a driver without nvmlDeviceGetFieldValues (the
    binding raises NVMLError_FunctionNotFound); `value_members` overrides the union member a field's value is
    written to (drivers differ in the valueType they report).
    """

    name: str
    uuid: str
    memory_total: int = 80 * 2**30
    refresh: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_REFRESH))
    unsupported: set[str] = field(default_factory=set)
    lost_at: float | None = None
    utilization_samples: bool = True
    compute_capability: tuple[int, int] = (9, 0)
    unknown_fields: set[int] = field(default_factory=set)
    field_values: bool = True
    value_members: dict[int, str] = field(default_factory=dict)


def two_gpus(**second: Any) -> list[FakeGPU]:
    """GPU 0 supports everything; GPU 1 gets the keyword arguments (unsupported=..., lost_at=...)."""
    return [
        FakeGPU("Fake GPU 0", "GPU-00000000-1111-2222-3333-444444444444"),
        FakeGPU("Fake GPU 1", "GPU-99999999-8888-7777-6666-555555555555", **second),
    ]


def _wave(bucket: int, low: int, step: int) -> int:
    # 3 and 7 are coprime: consecutive periods always give different values, as a real refresh would
    return low + step * ((bucket * 3) % 7)


class FakeNVML(types.ModuleType):
    """The fake module. `driver=False` makes nvmlInit raise NVMLError_LibraryNotFound, as on a host without one."""

    def __init__(
        self, gpus: list[FakeGPU] | None = None, clock: Callable[[], float] = time.monotonic, driver: bool = True
    ) -> None:
        super().__init__("pynvml")
        self.__dict__.update(CONSTANTS)
        self.__dict__.update(ERROR_CLASSES)
        self.NVMLError = NVMLError
        self.gpus = two_gpus() if gpus is None else gpus
        self.clock = clock
        self.t0 = clock()
        self.t0_unix = time.time()
        self.driver = driver
        self.init_count = 0
        self.calls = 0

    # -- helpers ---------------------------------------------------------------------------------------------
    def _gpu(self, handle: int, metric: str | None = None) -> FakeGPU:
        self.calls += 1
        if self.init_count <= 0:
            raise NVMLError(1)
        gpu = self.gpus[handle]
        if gpu.lost_at is not None and self.clock() - self.t0 >= gpu.lost_at:
            raise NVMLError(15)
        if metric is not None and metric in gpu.unsupported:
            raise NVMLError(3)
        return gpu

    def _bucket(self, gpu: FakeGPU, metric: str) -> int:
        return math.floor((self.clock() - self.t0) / gpu.refresh[metric])

    def _wave(self, gpu: FakeGPU, metric: str, low: int, step: int) -> int:
        return _wave(self._bucket(gpu, metric), low, step)

    # -- the pynvml API used by gpumon ----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.driver:
            raise NVMLError(12)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        if self.init_count <= 0:
            raise NVMLError(1)
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        if self.init_count <= 0:
            raise NVMLError(1)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu(index)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        self._gpu(handle)
        return 700_000

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle, "memory")
        used = self._wave(gpu, "memory", 2**30, 2**20)
        return SimpleNamespace(total=gpu.memory_total, used=used, free=gpu.memory_total - used)

    def nvmlDeviceGetFieldValues(self, handle: int, field_ids: list[Any]) -> ctypes.Array:
        values = (c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):  # the binding fills the request in the same array
            try:
                values[i].fieldId, values[i].scopeId = fid
            except TypeError:
                values[i].fieldId = fid
        gpu = self._gpu(handle)
        if not gpu.field_values:
            raise NVMLError(13)  # the binding's answer when the driver lacks the entry point
        elapsed = self.clock() - self.t0
        now_us = int((self.t0_unix + elapsed) * 1e6)
        for fv in values:
            fv.timestamp = now_us
            fid = fv.fieldId
            known = FIELDS.get(fid) if fid not in gpu.unknown_fields else None
            if known is None or known[0] in gpu.unsupported:
                fv.nvmlReturn = 3
                continue
            metric, member = known
            member = gpu.value_members.get(fid, member)
            bucket = math.floor(elapsed / gpu.refresh[metric])
            value = (
                bucket * gpu.refresh[metric] * POWER_W * 1000 if metric == "energy" else _wave(bucket, 250_000, 10_000)
            )
            fv.valueType = VALUE_TYPES[member]
            setattr(fv.value, member, float(value) if member == "dVal" else int(value))
        return values

    def _energy_mj(self, gpu: FakeGPU) -> int:
        return int(self._bucket(gpu, "energy") * gpu.refresh["energy"] * POWER_W * 1000)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        # The driver averages over 1 s on Ampere other than GA100 and newer (cc 8.6 and up), instantaneous before
        metric = "power_average" if self.gpus[handle].compute_capability >= (8, 6) else "power_instant"
        return self._wave(self._gpu(handle, metric), metric, 250_000, 10_000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self._energy_mj(self._gpu(handle, "energy"))

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return self._wave(self._gpu(handle, "temperature"), "temperature", 40, 1)

    def nvmlDeviceGetClockInfo(self, handle: int, kind: int) -> int:
        gpu = self._gpu(handle, "clocks")
        return self._wave(gpu, "clocks", 1500 if kind == 1 else 2600, 15)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        gpu = self._gpu(handle, "clock_events")
        return 0x4 if self._bucket(gpu, "clock_events") % 2 else 0x0

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle, "utilization")
        return SimpleNamespace(gpu=self._wave(gpu, "utilization", 30, 10), memory=self._wave(gpu, "utilization", 5, 5))

    def nvmlDeviceGetSamples(self, handle: int, kind: int, since: int) -> tuple[int, list[SimpleNamespace]]:
        gpu = self._gpu(handle)
        if not gpu.utilization_samples:
            raise NVMLError(3)
        step = int(gpu.refresh["utilization"] * 1e6)
        return 1, [SimpleNamespace(timeStamp=1_000_000 + i * step, sampleValue=None) for i in range(10)]

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        return self._wave(self._gpu(handle, "pcie"), "pcie", 1000 + 500 * counter, 100)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "processes")
        n = 1 + self._bucket(gpu, "processes") % 2
        return [SimpleNamespace(pid=1000 + i, usedGpuMemory=(i + 1) * 2**28) for i in range(n)]


@contextlib.contextmanager
def simulated_gpus(gpus: list[FakeGPU] | None = None) -> Iterator[FakeNVML]:
    """Within the block, `import pynvml` gives a FakeNVML of `gpus` (default: `two_gpus()`), all of them visible.

    CUDA_VISIBLE_DEVICES is set to every simulated GPU, so that the block sees the same GPUs whatever the host's
    setting; the previous module and environment come back on exit.

    Example:
        >>> import gpumon
        >>> with simulated_gpus():
        ...     [gpu["uuid"][:12] for gpu in gpumon.devices()]
        ['GPU-00000000', 'GPU-99999999']
    """
    fake = FakeNVML(gpus)
    visible = ",".join(str(i) for i in range(len(fake.gpus)))
    with mock.patch.dict(sys.modules, pynvml=fake), mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES=visible):
        yield fake


def simulated_recording(path: str | os.PathLike[str], seconds: float = 0.05) -> Path:
    """`path`: what `gpumon.Monitor` records of `simulated_gpus()` and the host in `seconds`, with the mark
    ("step", 0) at the start. A real recording to read, summarise or plot, for examples and tests.

    Example:
        >>> import tempfile
        >>> from gpumon import Recording
        >>> out = tempfile.TemporaryDirectory()
        >>> rec = Recording(simulated_recording(f"{out.name}/gpu.csv"))
        >>> rec.meta["backends"], [d.get("name") for d in rec.meta["devices"]]
        (['nvml', 'host'], ['Fake GPU 0', 'Fake GPU 1', None])
        >>> out.cleanup()
    """
    with simulated_gpus(), Monitor(out=path) as mon:
        mon.mark("step", 0)
        time.sleep(seconds)
    return Path(path)
