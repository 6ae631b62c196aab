"""Sampler cost and timing at 100 Hz: host backend, fake NVML (two simulated GPUs) + host, and a do-nothing thread.

The baseline thread wakes on the same absolute-deadline grid and does no work: it measures what merely waking
100 times a second costs on this machine, so the sampler's own share reads as a ratio against it.

    python benchmarks/bench_sampler.py [--seconds 10] [--rate 100]

"fake NVML calls alone" makes, in the same kind of thread, only the calls into the (fake) binding that a tick makes:
what the binding costs before gpumon does anything with the values. A last row runs the fake NVML + host tick work
back to back (no sleeping, caches warm): its CPU per tick, times the rate, is what the sampler would cost if
waking up were free. Prints a table; the last line is
`sampler_cpu_percent_at_100hz: <x>` for the fake-NVML + host configuration in its thread (what
`Monitor(backend="auto")` samples on a GPU host), in percent of one core.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpumon.fake_nvml import FakeNVML
from gpumon.statistics import percentile


def baseline(seconds: float, rate: float, work: Callable[[], object] = lambda: None) -> dict[str, float]:
    """A thread on the sampler's deadline grid that runs `work` at each wake-up (nothing by default)."""
    period, stamps, cpu = 1.0 / rate, [], [0.0]

    def run() -> None:
        start_cpu, t0, k = time.thread_time(), time.monotonic(), 0
        while True:
            delay = t0 + k * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now = time.monotonic() - t0
            if now >= seconds:
                break
            stamps.append(now)
            work()
            k = max(k + 1, math.floor((time.monotonic() - t0) / period))
        cpu[0] = time.thread_time() - start_cpu

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    errors = sorted(abs(b - a - period) for a, b in zip(stamps, stamps[1:], strict=False))
    span = stamps[-1] - stamps[0]
    return {
        "rate": (len(stamps) - 1) / span,
        "p99_ms": percentile(errors, 99) * 1e3,
        "us_per_sample": float("nan"),
        "cpu_pct": 100 * cpu[0] / seconds,
    }


def monitored(seconds: float, rate: float, backend: str, out: Path) -> dict[str, float]:
    import gpumon

    with gpumon.Monitor(rate_hz=rate, out=out, backend=backend):
        time.sleep(seconds)
    s = gpumon.summarize_recording(out)
    return {
        "rate": s.achieved_rate_hz,
        "p99_ms": s.interval_error_p99_ms,
        "us_per_sample": s.sampler_us_per_sample,
        "cpu_pct": s.sampler_cpu_percent,
        "columns": len(s.metrics),
        "bytes_per_s": out.stat().st_size / max(s.duration_s, 1e-9),
    }


def driver_calls_only(seconds: float, rate: float) -> dict[str, float]:
    """The NVML calls a tick makes (every-tick pollers of both fake GPUs), without the sampler around them."""
    from gpumon.nvml_backend import NVMLBackend

    nvml = NVMLBackend()
    reads = [p.read for p in nvml.pollers if p.period_s == 0 and not p.blocking]
    try:
        return baseline(seconds, rate, lambda: [read() for read in reads])
    finally:
        nvml.close()


def back_to_back(ticks: int, rate: float) -> dict[str, float]:
    """The same tick work (fake NVML + host, CSV written) run back to back: CPU per tick with warm caches."""
    from gpumon.host_backend import HostBackend
    from gpumon.nvml_backend import NVMLBackend
    from gpumon.sampler import Sampler

    nvml, host = NVMLBackend(), HostBackend()
    with tempfile.TemporaryDirectory() as tmp:
        sampler = Sampler(nvml.pollers + host.pollers, rate, out=Path(tmp) / "hot.csv")
        start = time.thread_time()
        for k in range(ticks):
            sampler.sample_once(k / rate)
        cpu = time.thread_time() - start
        sampler.stop()
    nvml.close()
    host.close()
    us = cpu / ticks * 1e6
    return {"rate": float("nan"), "p99_ms": float("nan"), "us_per_sample": us, "cpu_pct": us * rate / 1e4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0)
    args = parser.parse_args()
    rows = {"do-nothing thread (baseline)": baseline(args.seconds, args.rate)}
    with tempfile.TemporaryDirectory() as tmp:
        rows["host backend"] = monitored(args.seconds, args.rate, "host", Path(tmp) / "host.csv")
        sys.modules["pynvml"] = FakeNVML()  # two simulated GPUs, every metric supported
        rows["fake NVML (2 GPUs) + host"] = monitored(args.seconds, args.rate, "auto", Path(tmp) / "auto.csv")
        rows["fake NVML calls alone"] = driver_calls_only(args.seconds, args.rate)
    rows["same tick work, back to back"] = back_to_back(int(args.seconds * args.rate), args.rate)
    base_cpu = rows["do-nothing thread (baseline)"]["cpu_pct"]
    print(f"{args.seconds:g} s per configuration at {args.rate:g} Hz target")
    print(
        f"{'configuration':30} {'rate Hz':>8} {'p99 err ms':>10} {'us/sample':>10} {'CPU % core':>10} "
        f"{'x baseline':>10} {'metrics':>7} {'file KB/s':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:30} {r['rate']:8.2f} {r['p99_ms']:10.3f} {r['us_per_sample']:10.1f} {r['cpu_pct']:10.2f} "
            f"{r['cpu_pct'] / base_cpu:10.2f} {r.get('columns', 0):7d} {r.get('bytes_per_s', 0) / 1e3:9.1f}"
        )
    print(f"sampler_cpu_percent_at_100hz: {rows['fake NVML (2 GPUs) + host']['cpu_pct']:.2f}")


if __name__ == "__main__":
    main()
