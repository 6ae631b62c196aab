"""AdamW step time on CPU: DeepSpeed's CPU Adam against torch's AdamW (foreach and fused), fp32 parameters.

    DS_ACCELERATOR=cpu python benchmarks/bench_optimizer.py [--sizes 100e6 350e6] [--tensors 8] [--rounds 3]

This is the step ZeRO-Offload runs on the host (``offload_optimizer: {"device": "cpu"}``): each rank updates its
fp32 partition of the parameters there. The parameters are ``--tensors`` large tensors of equal size (a flat
partition is one or a few such tensors). Each implementation runs ``--steps`` timed steps after one untimed step
(which allocates the moments) per round; rounds alternate the implementations so that a change in the machine's load
falls on all of them. The first use of DeepSpeedCPUAdam JIT-builds its ``cpu_adam`` extension (about 45 s, cached in
``~/.cache/torch_extensions``): that build happens before any timing and is reported apart. Figures are medians of
all timed steps, printed as ratios to DeepSpeedCPUAdam; nothing is asserted. Last line: ``fastest: <name>``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch

BETAS, EPS, LR, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 3e-4, 0.1


def deepspeed_cpu_adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)


def torch_foreach(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)


def torch_fused(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)


IMPLEMENTATIONS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "DeepSpeedCPUAdam": deepspeed_cpu_adam,
    "torch AdamW foreach": torch_foreach,
    "torch AdamW fused": torch_fused,
}


def make_params(n: int, n_tensors: int) -> list[torch.nn.Parameter]:
    """``n`` fp32 parameters in ``n_tensors`` tensors, with random gradients."""
    g = torch.Generator().manual_seed(0)
    params = []
    for i in range(n_tensors):
        size = n // n_tensors + (1 if i < n % n_tensors else 0)
        p = torch.nn.Parameter(torch.randn(size, generator=g) * 0.02)
        p.grad = torch.randn(size, generator=g) * 1e-3
        params.append(p)
    return params


def time_steps(make: Callable, params: list[torch.nn.Parameter], steps: int) -> list[float]:
    opt = make(params)
    opt.step()  # allocates exp_avg / exp_avg_sq: not a steady-state step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt
    gc.collect()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[100e6, 350e6], help="parameter counts")
    ap.add_argument("--tensors", type=int, default=8, help="tensors the parameters are split into")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per implementation and round")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    deepspeed_cpu_adam(make_params(16, 1))  # loads, or on first use JIT-builds, the cpu_adam extension
    build_s = time.perf_counter() - t0
    print(f"cpu_adam extension loaded in {build_s:.1f} s (excluded from the timings; the first use builds it)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average at start "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip

    winners = []
    for size in args.sizes:
        n = int(size)
        params = make_params(n, args.tensors)
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(args.rounds):
            for name, make in IMPLEMENTATIONS.items():
                times[name] += time_steps(make, params, args.steps)
        med = {name: statistics.median(t) for name, t in times.items()}
        base = med["DeepSpeedCPUAdam"]
        print(f"\n{n / 1e6:.0f}M fp32 parameters in {args.tensors} tensors, median of {args.rounds} x {args.steps} "
              "steps:")  # fmt: skip
        print(f"  {'implementation':<22} {'ms/step':>9} {'min':>9} {'max':>9} {'x DeepSpeedCPUAdam':>19}")
        for name, m in med.items():
            t = times[name]
            print(f"  {name:<22} {m * 1e3:9.1f} {min(t) * 1e3:9.1f} {max(t) * 1e3:9.1f} {m / base:19.2f}")
        winners.append(min(med, key=med.get))
        del params
        gc.collect()
    print(f"\nload average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"fastest: {', '.join(f'{s / 1e6:.0f}M {w}' for s, w in zip(args.sizes, winners, strict=True))}")


if __name__ == "__main__":
    main()
