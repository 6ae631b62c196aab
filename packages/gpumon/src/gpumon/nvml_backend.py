"""NVML backend: per-GPU pollers with their own periods.

Values are recorded in NVML's native integer units (bytes, mW, mJ, degrees C, MHz, %, KB/s, a bitmask) so that
"the same value again" is an exact comparison and the file stays compact; the summary converts for display.

Default poll periods (seconds; 0 = every tick of the sampler):
    memory, power (instant + average + energy counter in one nvmlDeviceGetFieldValues call, see nvml_fields),
    clocks (SM, memory), clock_events: 0
    temperature: 0.1 (whole degrees C of a die whose thermal time constant is seconds: a faster read only
    repeats the same value)
    utilization: the device's own refresh window (from nvmlDeviceGetSamples timestamps; 1/6 s if unknown)
    pcie: 1.0 (NVML measures PCIe throughput over a 20 ms window, so each call can block that long)
    processes: 1.0 (the per-process listing costs milliseconds)
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from gpumon.nvml_devices import VisibleDevice, describe, load_nvml, visible_devices
from gpumon.nvml_fields import MISSING_CODES, FieldReader, power_columns
from gpumon.pollers import Failure, Poller

DEFAULT_PERIODS: dict[str, float | None] = {
    "memory": 0.0,
    "power": 0.0,
    "temperature": 0.1,  # integer degrees that move over seconds: 10 Hz loses nothing a plot could show
    "clocks": 0.0,
    "clock_events": 0.0,
    "utilization": None,  # None: the refresh window NVML reports for this device
    "pcie": 1.0,
    "processes": 1.0,
}
UTILIZATION_FALLBACK_S = 1.0 / 6.0  # NVML docs: utilisation refreshes every 1/6 s to 1 s depending on the product


class NVMLBackend:
    """Pollers for every visible GPU. Raises NVMLUnavailable when NVML cannot start.

    Example (two simulated GPUs from `gpumon.fake_nvml`; on a GPU host leave out `simulated_gpus()`):
        >>> from gpumon.fake_nvml import simulated_gpus
        >>> with simulated_gpus():
        ...     backend = NVMLBackend(periods={"pcie": 0.5})
        ...     [(p.name, p.period_s) for p in backend.pollers][:3], len(backend.pollers)
        ...     backend.close()
        ([('gpu0.memory', 0.0), ('gpu0.power', 0.0), ('gpu0.temperature', 0.1)], 16)
    """

    name = "nvml"

    def __init__(self, periods: Mapping[str, float | None] | None = None) -> None:
        unknown = sorted(set(periods or {}) - set(DEFAULT_PERIODS))
        if unknown:
            raise ValueError(f"periods: unknown metric group(s) {unknown}; allowed: {sorted(DEFAULT_PERIODS)}")
        self.periods = {**DEFAULT_PERIODS, **(periods or {})}
        for key, value in self.periods.items():
            if value is None and key != "utilization":
                raise ValueError(
                    f"periods[{key!r}] must be >= 0 seconds, got None (None, the device's own refresh window, is for "
                    "'utilization' only)"
                )
            if value is not None and value < 0:
                allowed = ">= 0 seconds or None" if key == "utilization" else ">= 0 seconds"
                raise ValueError(f"periods[{key!r}] must be {allowed}, got {value}")
        self.nvml: ModuleType = load_nvml()
        self._open = True
        try:
            self.devices = visible_devices(self.nvml)
            self.device_info = [describe(self.nvml, d) for d in self.devices]
            self.pollers: list[Poller] = []
            for dev, info in zip(self.devices, self.device_info, strict=True):
                self.pollers.extend(self._device_pollers(dev, info))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._open:
            self._open = False
            # shutting down after a lost GPU may fail; nothing is left to release then
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()

    def classify(self, exc: BaseException) -> Failure:
        nvml = self.nvml
        if isinstance(exc, nvml.NVMLError):
            code = getattr(exc, "value", None)
            if code == nvml.NVML_ERROR_NOT_SUPPORTED or code == MISSING_CODES["NVML_ERROR_FUNCTION_NOT_FOUND"]:
                return "unsupported"  # not on this device, or not in this driver
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                return "lost"
        if isinstance(exc, AttributeError):
            return "unsupported"  # an older binding without this call
        return "error"

    def utilization_window_s(self, handle: Any) -> float:
        """The device's utilisation refresh window, from the spacing of NVML's own utilisation samples."""
        try:
            _, samples = self.nvml.nvmlDeviceGetSamples(handle, self.nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
            stamps = sorted(int(s.timeStamp) for s in samples)
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
            if len(gaps) >= 2:
                return min(1.0, max(0.01, statistics.median(gaps) / 1e6))  # timestamps are in microseconds
        except Exception:
            pass
        return UTILIZATION_FALLBACK_S

    def _device_pollers(self, dev: VisibleDevice, info: dict[str, Any]) -> list[Poller]:
        nvml, h, g = self.nvml, dev.handle, f"gpu{dev.index}"
        period = self.periods
        fields = FieldReader(nvml, h, power_columns(nvml, g, info.get("compute_capability")))
        info["sources"] = fields.sources  # where each power column comes from, for the recording's header

        def read_clock_events() -> list[int]:
            getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            getter = getter or nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # bindings before 12.535
            return [int(getter(h))]

        def read_utilization() -> list[int]:
            u = nvml.nvmlDeviceGetUtilizationRates(h)
            return [int(u.gpu), int(u.memory)]

        def read_pcie() -> list[int]:
            return [
                int(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)),
                int(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)),
            ]

        def read_processes() -> list[Any]:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
            used = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
            listing = " ".join(f"{pid}:{mem}" for pid, mem in sorted(used)) or "-"  # an empty cell means "not read"
            return [len(used), sum(m for _, m in used), listing]

        util_period = period["utilization"]
        if util_period is None:
            util_period = self.utilization_window_s(h)

        def poller(name: str, columns: list[str], units: list[str], read: Any, **extra: Any) -> Poller:
            p = period[name]  # None only for utilization (checked in __init__)
            return Poller(
                f"{g}.{name}",
                g,
                columns,
                units,
                util_period if p is None else p,
                read,
                classify=self.classify,
                **extra,
            )

        return [
            poller("memory", [f"{g}.memory_used_bytes"], ["B"], lambda: [int(nvml.nvmlDeviceGetMemoryInfo(h).used)]),
            poller(
                "power",
                fields.columns,
                ["mW", "mW", "mJ"],
                fields.read,
                drop=fields.drop,
                partial=True,
                counter_columns={f"{g}.energy_mj"},
            ),
            poller(
                "temperature",
                [f"{g}.temperature_c"],
                ["C"],
                lambda: [int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))],
            ),
            poller(
                "clocks",
                [f"{g}.sm_clock_mhz", f"{g}.mem_clock_mhz"],
                ["MHz", "MHz"],
                lambda: [
                    int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                    int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
                ],
            ),
            poller("clock_events", [f"{g}.clock_event_reasons"], ["bitmask"], read_clock_events),
            poller("utilization", [f"{g}.util_gpu_pct", f"{g}.util_memory_pct"], ["%", "%"], read_utilization),
            poller("pcie", [f"{g}.pcie_tx_kbps", f"{g}.pcie_rx_kbps"], ["KB/s", "KB/s"], read_pcie, blocking=True),
            poller(
                "processes",
                [f"{g}.process_count", f"{g}.process_memory_bytes", f"{g}.processes"],
                ["count", "B", "pid:bytes"],
                read_processes,
                blocking=True,
            ),
        ]
