"""What one NVML call costs in Python: nvidia-ml-py over a do-nothing C function, against gpumon's fake module.

gpumon's sampler benchmark runs on `gpumon.fake_nvml`, a Python stand-in for the binding. This measures whether that
stand-in costs about what the real binding's own Python does. The real `pynvml` (nvidia-ml-py) is pointed at libc's
`labs` in place of every NVML entry point: called with the NULL device handle first, it returns 0 (NVML_SUCCESS)
without touching the other arguments, so each call runs all of nvidia-ml-py's Python (ctypes structures, the
function-pointer cache, argument conversion, the return-code check) and no driver work at all. A driver adds its
own time on top: these are lower bounds for the real calls.

    python benchmarks/bench_binding.py [--calls 20000]

Prints microseconds per call for the calls a 100 Hz tick makes per GPU, back to back (warm caches), and ends with
`fake_vs_binding_per_tick: <ratio>` (the fake's time for one GPU's tick calls over nvidia-ml-py's).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time
from collections.abc import Callable

import pynvml

from gpumon.fake_nvml import FakeNVML

FIELDS = [186, 185, 191]  # power instant, power average, energy: one nvmlDeviceGetFieldValues call per tick


class _NoDriver:
    """Every NVML symbol resolves to libc's labs: labs(NULL handle) == 0 == NVML_SUCCESS."""

    def __init__(self) -> None:
        self.labs = ctypes.CDLL(ctypes.util.find_library("c")).labs

    def __getattr__(self, name: str) -> Callable[..., int]:
        return self.labs


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(1000, calls)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    pynvml.nvmlLib = _NoDriver()
    pynvml._nvmlGetFunctionPointer_cache.clear()
    handle = pynvml.c_nvmlDevice_t()  # NULL
    binding = {
        "nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used,
        "nvmlDeviceGetFieldValues (3 fields)": lambda: pynvml.nvmlDeviceGetFieldValues(handle, FIELDS),
        "nvmlDeviceGetClockInfo": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
    }
    fake = FakeNVML()
    fake.nvmlInit()
    stand_in = {
        "nvmlDeviceGetMemoryInfo": lambda: fake.nvmlDeviceGetMemoryInfo(0).used,
        "nvmlDeviceGetFieldValues (3 fields)": lambda: fake.nvmlDeviceGetFieldValues(0, FIELDS),
        "nvmlDeviceGetClockInfo": lambda: fake.nvmlDeviceGetClockInfo(0, 1),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda: fake.nvmlDeviceGetCurrentClocksEventReasons(0),
    }
    # calls per GPU per tick at the default periods: memory, field values, two clocks (SM and memory), clock events
    per_tick = {
        "nvmlDeviceGetMemoryInfo": 1,
        "nvmlDeviceGetFieldValues (3 fields)": 1,
        "nvmlDeviceGetClockInfo": 2,
        "nvmlDeviceGetCurrentClocksEventReasons": 1,
    }
    print(f"{'call':40} {'nvidia-ml-py us':>15} {'fake us':>8} {'per tick':>8}")
    tick_binding = tick_fake = 0.0
    for name, count in per_tick.items():
        b, f = per_call_us(binding[name], args.calls), per_call_us(stand_in[name], args.calls)
        tick_binding += count * b
        tick_fake += count * f
        print(f"{name:40} {b:15.2f} {f:8.2f} {count:8d}")
    print(f"{'one GPU, one tick':40} {tick_binding:15.2f} {tick_fake:8.2f}")
    print(f"fake_vs_binding_per_tick: {tick_fake / tick_binding:.2f}")


if __name__ == "__main__":
    main()
