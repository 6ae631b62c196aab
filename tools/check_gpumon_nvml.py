"""Check gpumon's NVML backend against a real driver: per-call cost, achieved rate, and which metrics refresh.

Run on a GPU host (preferably under load, so that the metrics have a reason to change):

    python tools/check_gpumon_nvml.py [--rate 100] [--seconds 3] [--load]

1. Per-call cost: each metric group's read, `--calls` times back to back on GPU 0 (mean and p99, microseconds),
   and the power readings' calls alone: nvmlDeviceGetFieldValues with one and with all three fields gpumon asks
   for, against the per-metric calls that stand in where a driver lacks the fields.
2. For each metric group alone, a gpumon Sampler at `--rate` for `--seconds`: the achieved poll rate and the
   fraction of readings that differed from the previous one (fresh). fresh fraction x poll rate = how often NVML
   really refreshed that value; "refreshes at rate" is yes when at least 90% of readings were fresh.

`--load` runs a PyTorch matmul loop on GPU 0 meanwhile (torch needed for that flag only; gpumon never imports it).
Prints a markdown table for gpumon's README. Exits 2 with one line where there is no driver.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpumon.nvml_backend import DEFAULT_PERIODS, NVMLBackend
from gpumon.nvml_devices import NVMLUnavailable
from gpumon.sampler import Sampler
from gpumon.statistics import percentile

LOAD = """
import time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.monotonic() + {seconds}
i = 0
while time.monotonic() < end:
    y = x @ x
    extra = torch.empty(int((i % 7 + 1) * 2**27), dtype=torch.uint8, device="cuda")  # memory moves too
    del extra, y
    if i % 5 == 0:
        torch.cuda.empty_cache()
    i += 1
torch.cuda.synchronize()
"""


def call_costs(backend: NVMLBackend, calls: int) -> dict[str, tuple[float, float]]:
    costs = {}
    for p in backend.pollers:
        if not p.name.startswith("gpu0."):
            continue
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            with contextlib.suppress(Exception):  # an unsupported metric still has a cost worth knowing
                p.read()
            times.append(time.perf_counter() - start)
        times.sort()
        costs[p.name.split(".", 1)[1]] = (sum(times) / len(times) * 1e6, percentile(times, 99) * 1e6)
    return costs


def power_call_costs(backend: NVMLBackend, calls: int) -> dict[str, tuple[float, float]]:
    nvml, handle = backend.nvml, backend.devices[0].handle
    fields = [int(f.split()[1]) for f in backend.device_info[0]["sources"].values() if f.startswith("field ")]
    candidates = {
        f"nvmlDeviceGetFieldValues {fields[:1]}": lambda: nvml.nvmlDeviceGetFieldValues(handle, fields[:1]),
        f"nvmlDeviceGetFieldValues {fields}": lambda: nvml.nvmlDeviceGetFieldValues(handle, fields),
        "nvmlDeviceGetPowerUsage": lambda: nvml.nvmlDeviceGetPowerUsage(handle),
        "nvmlDeviceGetTotalEnergyConsumption": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle),
    }
    costs = {}
    for name, call in candidates.items():
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            with contextlib.suppress(Exception):
                call()
            times.append(time.perf_counter() - start)
        times.sort()
        costs[name] = (sum(times) / len(times) * 1e6, percentile(times, 99) * 1e6)
    return costs


def group_run(group: str, rate: float, seconds: float, out: Path) -> dict[str, dict]:
    backend = NVMLBackend({group: 0.0})  # this group at every tick; the others are not sampled at all
    pollers = [p for p in backend.pollers if p.name.split(".", 1)[1] == group]
    sampler = Sampler(pollers, rate_hz=rate, out=out)
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    backend.close()
    summary = sampler.summary()
    rows = {}
    for column, m in summary.metrics.items():
        reads = m["reads"]
        rows[column] = {
            "achieved": summary.achieved_rate_hz or 0.0,
            "polls_per_s": reads / summary.duration_s if summary.duration_s else 0.0,
            "fresh": m["fresh_fraction"],
            "errors": m["errors"],
        }
    for key in summary.errors:
        column = key.split(": ", 1)[0]
        rows.setdefault(column, {"achieved": 0.0, "polls_per_s": 0.0, "fresh": None, "errors": 0})
        rows[column]["error_text"] = key.split(": ", 1)[1]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=3.0, help="per metric group")
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls for the per-call cost")
    parser.add_argument("--load", action="store_true", help="run a torch matmul loop on GPU 0 meanwhile")
    args = parser.parse_args()
    try:
        backend = NVMLBackend()
    except NVMLUnavailable as exc:
        print(f"check_gpumon_nvml: {exc}; run this on a host with an NVIDIA driver", file=sys.stderr)
        return 2
    if not backend.devices:
        backend.close()
        print("check_gpumon_nvml: NVML works but no GPU is visible (CUDA_VISIBLE_DEVICES)", file=sys.stderr)
        return 2
    info = backend.device_info[0]
    costs = call_costs(backend, args.calls)
    power_costs = power_call_costs(backend, args.calls)
    backend.close()
    groups = list(DEFAULT_PERIODS)
    load = None
    if args.load:
        total = args.seconds * len(groups) + 10
        load = subprocess.Popen([sys.executable, "-c", LOAD.format(seconds=total)])
        time.sleep(5)  # CUDA context and the first kernels
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = {g: group_run(g, args.rate, args.seconds, Path(tmp) / f"{g}.csv") for g in groups}
    finally:
        if load is not None:
            load.kill()
            load.wait()
    print(
        f"GPU 0: {info['name']} (cc {info['compute_capability']}), {args.rate:g} Hz target, {args.seconds:g} s "
        f"per group, {'under a matmul load' if args.load else 'no load started by this check'}"
    )
    print(f"power and energy read from: {info.get('sources')}")
    print()
    print("| power call | us (mean / p99) |")
    print("|---|---|")
    for name, (mean, p99) in power_costs.items():
        print(f"| {name} | {mean:.1f} / {p99:.1f} |")
    print()
    print("| group | metric | call us (mean / p99) | polls/s | fresh | refreshes/s | refreshes at rate |")
    print("|---|---|---|---|---|---|---|")
    for group in groups:
        mean, p99 = costs.get(group, (float("nan"), float("nan")))
        for column, r in results[group].items():
            if not column.startswith("gpu0."):
                continue
            metric = column.split(".", 1)[1]
            if r["fresh"] is None:
                why = r.get("error_text", "no readings")
                print(f"| {group} | {metric} | {mean:.0f} / {p99:.0f} | - | - | - | {why} |")
                continue
            refresh = r["fresh"] * r["polls_per_s"]
            verdict = "yes" if r["fresh"] >= 0.9 else "no"
            print(
                f"| {group} | {metric} | {mean:.0f} / {p99:.0f} | {r['polls_per_s']:.1f} | "
                f"{100 * r['fresh']:.0f}% | {refresh:.1f} | {verdict} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
