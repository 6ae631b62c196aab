"""One CPU thread against all cores for a `cpu-small` training step (why `lmtrain train` probes the thread count).

    python tools/bench_threads.py [--steps 15] [--rounds 2]

The `cpu-small` model (lmcore preset, 2048-token vocabulary), batch 16 x 128 random token ids, torch AdamW. Each
round times `--steps` optimizer steps after one warm-up step, first with `torch.set_num_threads(1)` and then with
every core, so a burst of load from other processes falls on both. Prints tokens/s in wall time and per CPU second
of this process for each, the load average, and the ratio of one thread's wall-time speed to all cores'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from lmcore import GPT, ModelConfig

BATCH, SEQ_LEN = 16, 128


def time_steps(model: GPT, optimizer: torch.optim.Optimizer, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for `steps` training steps after one untimed warm-up step."""
    for i in range(steps + 1):
        if i == 1:
            wall0, cpu0 = time.perf_counter(), time.process_time()
        model(ids, ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - wall0, time.process_time() - cpu0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per measurement (default 15)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per thread count (default 2)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("cpu-small"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN))
    tokens = args.steps * BATCH * SEQ_LEN
    load_before = os.getloadavg()[0]
    rows: dict[int, list[tuple[float, float]]] = {1: [], cores: []}
    for _ in range(args.rounds):
        for threads in rows:
            torch.set_num_threads(threads)
            rows[threads].append(time_steps(model, optimizer, ids, args.steps))
    print(f"cpu-small ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), batch {BATCH} x {SEQ_LEN}, "
          f"{args.steps} steps per measurement, torch {torch.__version__}, {cores} cores")  # fmt: skip
    print(f"{'threads':>7}  {'tokens/s wall':>24}  {'tokens/s per CPU second':>24}")
    for threads, runs in rows.items():
        wall = " / ".join(f"{tokens / w:,.0f}" for w, _ in runs)
        cpu = " / ".join(f"{tokens / c:,.0f}" for _, c in runs)
        print(f"{threads:>7}  {wall:>24}  {cpu:>24}")
    best = {threads: max(tokens / w for w, _ in runs) for threads, runs in rows.items()}
    print(f"load average before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    print(f"one_thread_vs_{cores}: {best[1] / best[cores]:.2f}  (best wall-time speed of each; > 1: one is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
