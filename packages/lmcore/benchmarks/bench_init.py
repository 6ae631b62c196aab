"""Initialisation schemes compared on `cpu-small`: init_report at step 0, then a short training run on bytes.

TinyShakespeare as raw bytes (vocab 256, no tokenizer), the first 90% for training, the rest for validation.
Every scheme sees the same batches in the same order; AdamW, lr 1e-3 after a 20-step linear warmup,
no gradient clipping (so an exploding norm would show). Prints one row per scheme.

Reads TinyShakespeare from `shared/data/tinyshakespeare/input.txt` beside the repository root (`--data` to point
elsewhere); without the file it prints a `skipped:` line and exits 0.

    python benchmarks/bench_init.py [--steps 200] [--batch 8] [--seq-len 64] [--threads 1] [--data PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from lmcore import GPT, INIT_FUNCTIONS, ModelConfig, init_report

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def batches(data: torch.Tensor, n: int, batch: int, seq_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        yield window[:, :-1], window[:, 1:]


def grad_norm(model: GPT) -> float:
    return torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt().item()


def run(scheme: str, train: torch.Tensor, val: torch.Tensor, args) -> dict:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("cpu-small", vocab_size=256, context_length=args.seq_len, init=scheme, dropout=0.0)
    model = GPT(config)
    first = next(batches(train, 1, args.batch, args.seq_len, seed=1))
    report = init_report(model, first)
    blocks = [r for r in report.rows if r["name"].startswith("layers.")]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    norms, losses = [], []
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(train, args.steps, args.batch, args.seq_len, seed=2)):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        loss = model(x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(grad_norm(model))
        losses.append(loss.item())
        opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val_loss = sum(model(x, y).loss.item() for x, y in batches(val, 10, 16, args.seq_len, seed=3)) / 10
    return {
        "scheme": scheme,
        "loss0": report.loss,
        "emb_rms": report.rows[0]["activation_rms"],
        "last_rms": blocks[-1]["activation_rms"],
        "g_first": blocks[0]["grad_norm"],
        "g_last": blocks[-1]["grad_norm"],
        "max_gnorm": max(norms),
        "max_gnorm_step": norms.index(max(norms)),
        "train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "val_loss": val_loss,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, default=DATA, help="TinyShakespeare input.txt")
    args = parser.parse_args()
    if not args.data.is_file():
        print(f"skipped: {args.data} is absent (expected ../shared/data next to the repository root, or --data)")
        return
    torch.set_num_threads(args.threads)
    data = torch.tensor(list(args.data.read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    config = ModelConfig.from_preset("cpu-small", vocab_size=256, context_length=args.seq_len)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}; "
        f"cpu-small ({config.n_layer} layers, width {config.d_model}, {config.n_head} heads, vocab 256 bytes), "
        f"{args.steps} steps x {args.batch} x {args.seq_len} tokens, ln(256)={math.log(256):.3f}"
    )
    header = ("scheme", "loss@0", "rms emb", "rms last", "|g| blk0", "|g| blkN", "max |g|", "@step", "train", "val")
    print(" | ".join(f"{h:>8}" for h in header))
    for scheme in INIT_FUNCTIONS:
        r = run(scheme, train, val, args)
        cells = [
            r["scheme"],
            r["loss0"],
            r["emb_rms"],
            r["last_rms"],
            r["g_first"],
            r["g_last"],
            r["max_gnorm"],
            r["max_gnorm_step"],
            r["train_loss"],
            r["val_loss"],
        ]
        print(
            " | ".join(f"{c:>8.4g}" if isinstance(c, float) else f"{c:>8}" for c in cells) + f"  ({r['seconds']:.0f}s)"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
