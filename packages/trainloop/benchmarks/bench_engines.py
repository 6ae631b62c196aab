"""The three engines on the same model, data and steps, 2 gloo ranks on CPU: DDP (engine="torch"), DeepSpeed ZeRO-2
and FSDP (fully_shard): median step time as a ratio to DDP, peak RSS per rank, checkpoint save and load time.

    DS_ACCELERATOR=cpu python benchmarks/bench_engines.py [--models cpu-small,26m] [--steps 12] [--engines ...]

Models are lmcore GPTs (this benchmark needs lmcore installed; trainloop itself never imports it): the cpu-small
preset (1.06M parameters) and a 26M one (7 layers, width 512, vocabulary 8192). fp32, micro batch 4 x 128 tokens
per rank, one thread per rank. Step time is the interval between successive batch requests after the first two
steps (start-up excluded); the save is one whole atomic checkpoint (engine files, consolidated weights, SHA-256
manifest), the load restores it into the running engine. Peak RSS is each rank's ru_maxrss over the whole process
(imports included). Timings are printed, never asserted; on a shared machine compare the ratios, measured in the
same invocation, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ENGINES = ("ddp", "zero2", "fsdp")
SEQ, MICRO = 128, 4


def model_config(name: str):
    from lmcore import ModelConfig

    if name == "26m":
        return ModelConfig(vocab_size=8192, n_layer=7, n_head=8, d_model=512, context_length=SEQ)
    return ModelConfig.from_preset(name)


class TimedData:
    """Fixed random token windows (each rank its own rows); records when each batch is requested."""

    def __init__(self, n: int, vocab: int, rank: int) -> None:
        g = torch.Generator().manual_seed(1000 + rank)
        rows = torch.randint(0, vocab, (n, MICRO, SEQ + 1), generator=g)
        self.batches = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
        self.times: list[float] = []

    def __iter__(self):
        for b in self.batches:
            self.times.append(time.perf_counter())
            yield b


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: train, then time one save and one load; every rank prints one RESULT line."""
    from lmcore import GPT, n_params
    from trainloop import TrainConfig, Trainer
    from trainloop.distributed import barrier

    rank = int(os.environ["RANK"])
    engine = {"ddp": "torch", "zero2": "deepspeed", "fsdp": "fsdp"}[args.engine]
    cfg = TrainConfig(max_steps=args.steps, micro_batch=MICRO, engine=engine, log_every=10**6, progress=False,
                      save_every=0, keep_last=1)  # fmt: skip
    config = model_config(args.model)
    torch.manual_seed(0)
    data = TimedData(args.steps + 1, config.vocab_size, rank)
    ds = {"zero_optimization": {"stage": 2}} if engine == "deepspeed" else None
    trainer = Trainer(GPT(config), cfg, data, run_dir=args.run_dir, ds_config=ds)
    trainer.fit()
    barrier()
    t0 = time.perf_counter()
    ckpt = trainer.save_checkpoint()
    save_s = time.perf_counter() - t0
    barrier()
    t0 = time.perf_counter()
    trainer.load_checkpoint(ckpt)
    barrier()
    load_s = time.perf_counter() - t0
    steps = [b - a for a, b in zip(data.times[2:], data.times[3:], strict=False)]
    result = {"rank": rank, "params": n_params(config), "step_s": statistics.median(steps), "save_s": save_s,
              "load_s": load_s, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())  # one write: ranks share stdout
    trainer.close()


def launch(model: str, engine: str, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "TQDM_DISABLE": "1"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               __file__, "--worker", "--model", model, "--engine", engine, "--steps", str(steps),
               "--run-dir", tmp]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    results = [json.loads(ln[7:]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if len(results) != 2:
        raise RuntimeError(f"{model}/{engine} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="cpu-small,26m")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        import lmcore  # noqa: F401
    except ImportError:
        sys.exit("bench_engines.py: needs lmcore for its models: pip install packages/lmcore")
    engines = args.engines.split(",")
    print(f"2 gloo ranks, fp32, micro batch {MICRO} x {SEQ} tokens per rank, {args.steps} steps, 1 thread per rank")
    print(f"load average before: {loadavg()}")
    print(f"{'model':<10}{'engine':<8}{'params':>10}{'step ms':>10}{'vs ddp':>8}{'rss MiB r0/r1':>16}"
          f"{'save s':>8}{'load s':>8}")  # fmt: skip
    for model in args.models.split(","):
        rows = {engine: launch(model, engine, args.steps) for engine in engines}
        base = statistics.mean(r["step_s"] for r in rows["ddp"]) if "ddp" in rows else None
        for engine, results in rows.items():
            step = statistics.mean(r["step_s"] for r in results)
            ratio = f"{step / base:.2f}" if base else "-"
            rss = "/".join(f"{r['rss_mib']:.0f}" for r in results)
            save, load = max(r["save_s"] for r in results), max(r["load_s"] for r in results)
            print(f"{model:<10}{engine:<8}{results[0]['params'] / 1e6:>9.2f}M{1e3 * step:>10.1f}{ratio:>8}{rss:>16}"
                  f"{save:>8.2f}{load:>8.2f}")  # fmt: skip
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
