"""How `cpu-small` and its recipe were chosen: a few sizes and settings at the same CPU-time budget.

    python tools/tune_cpu_small.py [--cpu-budget 120] [--workdir DIR] [--rows 0 3]

TinyShakespeare with nanoGPT's 90/10 split, prepared once by `lmtrain prepare` with its defaults (BPE, 2048
pieces). Each row trains with `lmtrain train --preset cpu-small`, the row's width, layers, context, batch and
learning rate set with `--set`, one CPU thread, a cosine schedule (30 warmup steps, floor at a tenth of the peak)
over as many steps as `--cpu-budget` CPU seconds allow: the step count is the budget over the CPU time of one
step of that model, timed here first. The rest is the preset's recipe (AdamW, weight decay 0.1 on matrices, clip
1.0, fp32). Then `lmtrain eval --json` scores the whole validation split as the headline benchmark does (sliding
windows of the training length, advancing by half of it). CPU time, not wall time, sets the budget so that other
work on a shared machine changes the speed less than the result; the script prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from bench_shakespeare import children_usage, lmtrain, prepare_split

from lmcore import GPT, ModelConfig

# (width, layers, context, batch, peak lr); 4 heads and an MLP of 4 x width each. The last is `cpu-small` as shipped.
ROWS = [
    (256, 4, 256, 16, 2e-3),
    (128, 4, 256, 16, 3e-3),
    (128, 4, 256, 16, 5e-3),
    (128, 4, 256, 8, 3e-3),
    (128, 4, 256, 4, 2e-3),
    (128, 4, 128, 16, 3e-3),
]
WARMUP_STEPS = 30


def cpu_seconds_per_step(width: int, layers: int, context: int, batch: int, vocab_size: int) -> float:
    """CPU seconds of one training step of this model on one thread (best of three after a warm-up step)."""
    torch.set_num_threads(1)
    model = GPT(ModelConfig.from_preset("cpu-small", d_model=width, d_ff=4 * width, n_layer=layers,
                                        context_length=context, vocab_size=vocab_size))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    ids = torch.randint(0, vocab_size, (batch, context))
    best = float("inf")
    for i in range(4):
        t0 = time.process_time()
        model(ids, ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            best = min(best, time.process_time() - t0)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-budget", type=float, default=120.0, help="CPU seconds of training per row")
    parser.add_argument("--workdir", default=None, help="keep data and runs here (default: a temporary directory)")
    parser.add_argument("--rows", type=int, nargs="*", default=None, help="indices into the table (default: all)")
    args = parser.parse_args()
    prepared = prepare_split(args.workdir, "tune-cpu-small-")
    if prepared is None:
        return 0
    work, val_txt, val_chars, _ = prepared
    vocab_size = json.loads((work / "data" / "meta.json").read_text())["vocab_size"]
    load_before = os.getloadavg()[0]

    header = ("width", "layers", "context", "batch", "lr", "steps", "train CPU s", "tokens / CPU s", "params",
              "val loss", "bits/char")  # fmt: skip
    print(" | ".join(header), flush=True)
    for index in args.rows if args.rows is not None else range(len(ROWS)):
        width, layers, context, batch, lr = ROWS[index]
        steps = max(WARMUP_STEPS + 10, int(args.cpu_budget / cpu_seconds_per_step(width, layers, context, batch,
                                                                                   vocab_size)))  # fmt: skip
        run = work / f"run{index}"
        cpu0, _ = children_usage()
        train, _ = lmtrain(
            "train", "--json", "--data", str(work / "data"), "--out", str(run), "--preset", "cpu-small",
            "--max-steps", str(steps), "--set", f"d_model={width}", "--set", f"d_ff={4 * width}",
            "--set", f"n_layer={layers}", "--set", f"context_length={context}", "--set", f"micro_batch={batch}",
            "--set", f"lr={lr}", "--set", f"min_lr={lr / 10}", "--set", "schedule=cosine",
            "--set", f"warmup_steps={WARMUP_STEPS}", "--set", "cpu_threads=1", "--set", "log_every=50",
        )  # fmt: skip
        cpu_s = children_usage()[0] - cpu0  # the whole train command, start-up included
        summary = json.loads(train.stdout.strip().splitlines()[-1])["summary"]
        ev, _ = lmtrain("eval", "--run", str(run), "--text", str(val_txt), "--json")
        result = json.loads(ev.stdout.strip().splitlines()[-1])
        n_params = json.loads((run / "run.json").read_text())["n_params"]
        row = (width, layers, context, batch, f"{lr:g}", summary["step"], f"{cpu_s:.0f}",
               f"{summary['tokens_seen'] / cpu_s:,.0f}", f"{n_params / 1e6:.2f}M", f"{result['loss']:.3f}",
               f"{result['bits_per_byte'] * result['bytes'] / val_chars:.3f}")  # fmt: skip
        print(" | ".join(map(str, row)), flush=True)
    print(f"load average before / after ({os.cpu_count()} cores): {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    print(f"work directory: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
