"""Sampler cost and timing at 100 Hz: host backend, fake NVML (two simulated GPUs) + host, and the floors under them.

The baseline thread wakes on the same absolute-deadline grid and does no work: it measures what merely waking
100 times a second costs on this machine.

    python benchmarks/bench_sampler.py [--seconds 10] [--rate 100] [--slices 5]

"NVML calls alone" makes, in the same kind of thread, only the calls into the (fake) binding that a tick makes at
every tick. "all reads alone (floor)" makes every read the sampler makes, each at its own period (NVML at every
tick, temperature and the host's /proc reads at 10 Hz, PCIe and the process listing at 1 Hz), and nothing else:
what reading costs before gpumon does anything with the values. "gpumon's own share" is the sampler's CPU minus
that floor: the scheduling, the queue, the cells, the statistics and the file. The sampler and the floor run in
alternating slices (`--slices`, each seconds/slices long) so that a change in the machine's load during the run
falls on both alike. A last row runs the same tick work back to back (no sleeping, caches warm): its CPU per tick,
times the rate, is what the sampler would cost if waking up were free. Prints a table, then
`sampler_cpu_percent_at_100hz: <x>` (the fake-NVML + host sampler in its thread, what `Monitor(backend="auto")`
samples on a GPU host) and `gpumon_share_percent_at_100hz: <y>` (that minus the floor), in percent of one core.
"""

from __future__ import annotations

import argparse
import math
import os
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


def read_schedule(pollers: list, rate: float) -> Callable[[], None]:
    """A function that makes the reads due at the next tick, each poller at its own period, and nothing else.

    The reads due at each tick are worked out beforehand; periodic pollers start one tick apart, as the sampler
    staggers them.
    """
    every = [max(1, round(p.period_s * rate)) for p in pollers]
    cycle = math.lcm(*every)
    schedule = [
        [p.read for i, (n, p) in enumerate(zip(every, pollers, strict=True)) if k % n == i % n] for k in range(cycle)
    ]
    ticks = [0]

    def tick() -> None:
        k = ticks[0]
        for read in schedule[k % cycle]:
            read()
        ticks[0] = k + 1

    return tick


def calls_alone(seconds: float, rate: float, every_period: bool) -> dict[str, float]:
    """The reads of fake NVML + host in a thread on the grid, with nothing done with the values.

    every_period=False: only the NVML calls made at every tick; True: every poller at its own period (the floor).
    """
    from gpumon.host_backend import HostBackend
    from gpumon.nvml_backend import NVMLBackend

    nvml, host = NVMLBackend(), HostBackend()
    pollers = nvml.pollers + host.pollers if every_period else [p for p in nvml.pollers if not p.period_s]
    try:
        return baseline(seconds, rate, read_schedule(pollers, rate))
    finally:
        nvml.close()
        host.close()


def back_to_back(ticks: int, rate: float, reads_only: bool) -> dict[str, float]:
    """The tick work (fake NVML + host) run back to back, CPU per tick with warm caches: the floor's reads alone
    (reads_only), or the sampler's reader and processor as its thread runs them, a batch at a time, CSV written."""
    from gpumon.host_backend import HostBackend
    from gpumon.nvml_backend import NVMLBackend
    from gpumon.sampler import Sampler

    now = [0.0]  # the fake GPUs' clock follows the ticks, so that values change as often as at the real rate
    sys.modules["pynvml"] = FakeNVML(clock=lambda: now[0])
    nvml, host = NVMLBackend(), HostBackend()
    with tempfile.TemporaryDirectory() as tmp:
        sampler = Sampler(nvml.pollers + host.pollers, rate, out=Path(tmp) / "hot.csv")
        reader, processor, reads = sampler.reader, sampler.processor, read_schedule(nvml.pollers + host.pollers, rate)
        start = time.thread_time()
        for k in range(ticks):
            now[0] = k / rate
            if reads_only:
                reads()
            elif reader.tick(k / rate):
                processor.process(reader.take(), marks=[])
        cpu = time.thread_time() - start
        sampler.stop()
    nvml.close()
    host.close()
    us = cpu / ticks * 1e6
    return {"rate": float("nan"), "p99_ms": float("nan"), "us_per_sample": us, "cpu_pct": us * rate / 1e4}


def add(total: dict[str, float], part: dict[str, float], seconds: float) -> None:
    """Accumulate a slice: CPU and wall-time figures weighted by the slice's length."""
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value * seconds
    total["_s"] = total.get("_s", 0.0) + seconds


def mean(total: dict[str, float]) -> dict[str, float]:
    return {k: v / total["_s"] for k, v in total.items() if k != "_s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--slices", type=int, default=5, help="alternate sampler and floor in this many slices")
    args = parser.parse_args()
    load = os.getloadavg()
    rows = {"do-nothing thread (baseline)": baseline(args.seconds, args.rate)}
    piece = args.seconds / args.slices
    sampler: dict[str, float] = {}
    floor: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["host backend"] = monitored(args.seconds, args.rate, "host", Path(tmp) / "host.csv")
        sys.modules["pynvml"] = FakeNVML()  # two simulated GPUs, every metric supported
        for k in range(args.slices):
            add(floor, calls_alone(piece, args.rate, every_period=True), piece)
            add(sampler, monitored(piece, args.rate, "auto", Path(tmp) / f"auto{k}.csv"), piece)
        rows["fake NVML (2 GPUs) + host"] = mean(sampler)
        rows["NVML calls alone"] = calls_alone(args.seconds, args.rate, every_period=False)
        rows["all reads alone (floor)"] = mean(floor)
    share = rows["fake NVML (2 GPUs) + host"]["cpu_pct"] - rows["all reads alone (floor)"]["cpu_pct"]
    nan = float("nan")
    rows["gpumon's own share (- floor)"] = {"rate": nan, "p99_ms": nan, "us_per_sample": nan, "cpu_pct": share}
    ticks = int(args.seconds * args.rate)
    rows["all reads, back to back"] = back_to_back(ticks, args.rate, reads_only=True)
    rows["same tick work, back to back"] = back_to_back(ticks, args.rate, reads_only=False)
    warm = rows["same tick work, back to back"]["cpu_pct"] - rows["all reads, back to back"]["cpu_pct"]
    rows["gpumon's share, back to back"] = {"rate": nan, "p99_ms": nan, "us_per_sample": warm * 1e4 / args.rate,
                                            "cpu_pct": warm}  # fmt: skip
    base_cpu = rows["do-nothing thread (baseline)"]["cpu_pct"]
    print(f"{args.seconds:g} s per configuration at {args.rate:g} Hz target; load average before {load[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f} (1 min)")  # fmt: skip
    print(
        f"{'configuration':30} {'rate Hz':>8} {'p99 err ms':>10} {'us/sample':>10} {'CPU % core':>10} "
        f"{'x baseline':>10} {'metrics':>7} {'file KB/s':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:30} {r['rate']:8.2f} {r['p99_ms']:10.3f} {r['us_per_sample']:10.1f} {r['cpu_pct']:10.2f} "
            f"{r['cpu_pct'] / base_cpu:10.2f} {round(r.get('columns', 0)):7d} {r.get('bytes_per_s', 0) / 1e3:9.1f}"
        )
    print(f"sampler_cpu_percent_at_100hz: {rows['fake NVML (2 GPUs) + host']['cpu_pct']:.2f}")
    print(f"gpumon_share_percent_at_100hz: {share:.2f}")


if __name__ == "__main__":
    main()
