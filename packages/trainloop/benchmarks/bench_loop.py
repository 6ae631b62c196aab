"""Per-step overhead of trainloop's Trainer against a bare hand-written loop, and 1 vs 2 ranks ZeRO-2 on CPU.

    DS_ACCELERATOR=cpu python benchmarks/bench_loop.py [--rounds 5] [--steps 60] [--skip-zero]

Part 1 runs the same model, data, AdamW, schedule and gradient clipping both ways, alternating rounds, and compares
median step times (step time = interval between successive batch requests, so start-up and the final checkpoint are
excluded). Part 2 launches torchrun with 1 and 2 gloo ranks, DeepSpeed ZeRO-2, fp32, the same global batch.
Timings are printed, never asserted. Last line: ``loop_overhead: <fraction>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

VOCAB, D, SEQ, BATCH = 256, 128, 64, 8


class BenchLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.norm_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs)  # (B, T, D)
        h = h + self.mlp(h)
        return nn.functional.cross_entropy(self.head(self.norm_f(h)).flatten(0, 1), targets.flatten())


class TimedData:
    """Fixed random batches; records when each batch is requested."""

    def __init__(self, n: int, batch: int = BATCH, rank: int = 0, world: int = 1) -> None:
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(0, VOCAB, (n, batch * world, SEQ + 1), generator=g)[:, rank * batch : (rank + 1) * batch]
        self.batches = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
        self.times: list[float] = []

    def __iter__(self):
        for b in self.batches:
            self.times.append(time.perf_counter())
            yield b

    def step_times(self) -> list[float]:
        t = self.times
        return [b - a for a, b in zip(t[5:], t[6:], strict=False)]  # skip warm-up steps


def bare_loop(steps: int) -> list[float]:
    from trainloop import TrainConfig, lr_at

    cfg = TrainConfig(max_steps=steps, warmup_steps=5, clip=1.0)
    torch.manual_seed(0)
    model = BenchLM()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    # The optimizer Trainer builds (trainloop.engine.make_adamw: fused on CPU), so only the loop around it differs.
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)  # fmt: skip
    data = TimedData(steps + 1)
    it = iter(data)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = next(it)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if math.isfinite(loss.item()) and math.isfinite(norm.item()):
            opt.step()
        opt.zero_grad(set_to_none=True)
    next(it, None)
    return data.step_times()


def trainer_loop(steps: int, run_dir: Path) -> list[float]:
    from trainloop import TrainConfig, Trainer

    cfg = TrainConfig(max_steps=steps, warmup_steps=5, clip=1.0, log_every=20, progress=False, tensorboard=False)
    torch.manual_seed(0)
    data = TimedData(steps + 1)
    Trainer(BenchLM(), cfg, data, run_dir=run_dir).fit()
    return data.step_times()


def zero_worker(args: argparse.Namespace) -> None:
    """Run under torchrun: ZeRO-2 fp32 with a global batch of 16 rows; rank 0 prints the median step time."""
    from trainloop import TrainConfig, Trainer

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    micro = 16 // world
    cfg = TrainConfig(max_steps=args.steps, micro_batch=micro, engine="deepspeed", log_every=10**6, progress=False,
                      tensorboard=False)  # fmt: skip
    torch.manual_seed(0)
    data = TimedData(args.steps + 1, batch=micro, rank=rank, world=world)
    Trainer(BenchLM(), cfg, data, run_dir=args.run_dir, ds_config={"zero_optimization": {"stage": 2}}).fit()
    if rank == 0:
        print("ZERO_STEP_S " + json.dumps(statistics.median(data.step_times())), flush=True)


def zero_step_time(nproc: int, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               __file__, "--zero-worker", "--steps", str(steps), "--run-dir", tmp]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ZERO_STEP_S ")), None)
    if line is None:
        raise RuntimeError(f"zero worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-zero", action="store_true")
    parser.add_argument("--zero-worker", action="store_true")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    if args.zero_worker:
        zero_worker(args)
        return
    torch.set_num_threads(1)
    bare, loop = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            bare += bare_loop(args.steps)
            loop += trainer_loop(args.steps, Path(tmp) / f"r{r}")
    b, t = statistics.median(bare), statistics.median(loop)
    print(f"model: {sum(p.numel() for p in BenchLM().parameters())} params, batch {BATCH}x{SEQ}, fp32, 1 thread")
    print(f"{'loop':<28}{'median step ms':>16}{'steps timed':>13}")
    print(f"{'bare hand-written':<28}{1e3 * b:>16.3f}{len(bare):>13}")
    print(f"{'trainloop.Trainer':<28}{1e3 * t:>16.3f}{len(loop):>13}")
    if not args.skip_zero:
        one = zero_step_time(1, args.steps)
        two = zero_step_time(2, args.steps)
        print("ZeRO-2 fp32 on CPU, global batch 16 rows, gloo, 1 thread per rank")
        print(f"{'ranks':<8}{'median step ms':>16}{'vs 1 rank':>11}")
        print(f"{1:<8}{1e3 * one:>16.2f}{1.0:>11.2f}")
        print(f"{2:<8}{1e3 * two:>16.2f}{two / one:>11.2f}")
    print(f"loop_overhead: {t / b - 1:.4f}")


if __name__ == "__main__":
    main()
