"""Forward+backward tokens/s of lmcore.GPT (ALiBi) against a plain same-size GPT (learned positions, causal SDPA).

The baseline is written here, nanoGPT style: fused qkv projection, learned position embedding,
F.scaled_dot_product_attention(is_causal=True), GELU MLP, LayerNorm with bias, tied embeddings.
Repetitions of the two models are interleaved so that load from other processes hits both alike;
the reported figures are medians over repetitions, the ratios medians of paired per-repetition ratios, of wall
time and of this process's CPU time (less sensitive to other processes on a shared machine). Prints a table,
then the ratio lines `alibi_model_vs_plain_T512:` and `alibi_model_vs_plain:` (nanoGPT's CPU "baby" size:
4 layers, 4 heads, width 128, B=12, T=64).
A second table times the same ALiBi model with `document_separator` set against it unset, on one batch whose
rows hold packed documents of a given mean length (ratio = unset time / set time; < 1: document attention slower).

    python benchmarks/bench_model.py [--reps 15] [--iters 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import lmcore
from lmcore import GPT, ModelConfig


class PlainBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """The baseline: learned absolute positions and PyTorch's causal SDPA."""

    def __init__(self, vocab: int, n_layer: int, n_head: int, d: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(PlainBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def step_time(step, iters: int) -> tuple[float, float]:
    """Seconds per call of `step`: wall-clock, and CPU time of this process (which other processes' load does not
    inflate, to first order: with one thread, waiting for a core is not counted)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    return (time.perf_counter() - wall) / iters, (time.process_time() - cpu) / iters


def compare(steps: dict, reps: int, iters: int) -> dict[str, float]:
    """Two steps {"base": fn, "new": fn} in interleaved repetitions (who goes first alternates).

    Returns the median wall seconds of each, and the medians of the paired per-repetition ratios base / new of
    wall time ("ratio") and of CPU time ("cpu_ratio"); > 1: "new" is faster.
    """
    for step in steps.values():  # warm-up: allocator, bias cache, oneDNN primitives
        step_time(step, 2)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    ratios, cpu_ratios = [], []
    for rep in range(reps):
        order = list(steps) if rep % 2 == 0 else list(reversed(steps))
        times = {name: step_time(steps[name], iters) for name in order}
        for name, (t, _) in times.items():
            wall[name].append(t)
        ratios.append(times["base"][0] / times["new"][0])
        cpu_ratios.append(times["base"][1] / times["new"][1])
    return {
        "base_s": statistics.median(wall["base"]),
        "new_s": statistics.median(wall["new"]),
        "ratio": statistics.median(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
    }


def measure(T: int, B: int, reps: int, iters: int, vocab: int = 65) -> dict[str, float]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, n_layer=4, n_head=4, d_model=128, context_length=T, dropout=0.0)
    alibi, plain = GPT(config), PlainGPT(vocab, 4, 4, 128, T)
    idx = torch.randint(0, vocab, (B, T))
    tgt = torch.randint(0, vocab, (B, T))

    def alibi_step():
        alibi.zero_grad(set_to_none=True)
        alibi(idx, tgt).loss.backward()

    def plain_step():
        plain.zero_grad(set_to_none=True)
        plain(idx, tgt).backward()

    r = compare({"base": plain_step, "new": alibi_step}, reps, iters)
    return {"alibi": B * T / r["new_s"], "plain": B * T / r["base_s"], "ratio": r["ratio"], "cpu_ratio": r["cpu_ratio"]}


def packed_batch(B: int, T: int, mean_doc: int, vocab: int, sep: int) -> torch.Tensor:
    """(B, T) ids from [1, vocab) with `sep` at random positions, one in `mean_doc` tokens on average."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(1, vocab, (B, T), generator=g)
    idx[torch.rand(B, T, generator=g) < 1 / mean_doc] = sep
    return idx


def measure_documents(T: int, B: int, mean_doc: int, reps: int, iters: int, vocab: int = 65) -> dict[str, float]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, n_layer=4, n_head=4, d_model=128, context_length=T, dropout=0.0)
    plain = GPT(config)
    documents = GPT(ModelConfig.from_dict({**config.to_dict(), "document_separator": 0}))
    documents.load_state_dict(plain.state_dict())
    idx = packed_batch(B, T, mean_doc, vocab, sep=0)
    n_docs = len(lmcore.document_boundaries(idx, 0).cu_seqlens) - 1

    def step(model):
        model.zero_grad(set_to_none=True)
        model(idx, idx).loss.backward()

    r = compare({"base": lambda: step(plain), "new": lambda: step(documents)}, reps, iters)
    return {
        "n_docs": n_docs,
        "plain_ms": 1e3 * r["base_s"],
        "documents_ms": 1e3 * r["new_s"],
        "ratio": r["ratio"],
        "cpu_ratio": r["cpu_ratio"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5)
    # One thread by default: on a shared 2-core box, two OpenMP threads spin against other processes and the
    # timings swing several-fold; --threads 0 leaves torch's own choice.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} reps x {args.iters} iters, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results = {}
    for T, reps in ((512, max(3, args.reps // 3)), (64, args.reps)):
        results[T] = measure(T, 12, reps, args.iters)
    print(f"{'T':>5} {'B':>3} {'alibi tok/s':>12} {'plain tok/s':>12} {'ratio':>7} {'cpu ratio':>9}")
    for T, r in results.items():
        print(f"{T:>5} {12:>3} {r['alibi']:>12.0f} {r['plain']:>12.0f} {r['ratio']:>7.3f} {r['cpu_ratio']:>9.3f}")
    print(f"alibi_model_vs_plain_T512: {results[512]['ratio']:.3f} (CPU time {results[512]['cpu_ratio']:.3f})")
    print(f"alibi_model_vs_plain: {results[64]['ratio']:.3f} (CPU time {results[64]['cpu_ratio']:.3f})")
    print("\ndocument_separator set vs unset (same ALiBi model and batch), forward+backward")
    print(f"{'T':>5} {'B':>3} {'mean doc':>8} {'docs':>5} {'unset ms':>9} {'set ms':>9} {'ratio':>7} {'cpu ratio':>9}")
    for T, mean_doc in ((256, 64), (256, 16)):
        r = measure_documents(T, 12, mean_doc, max(3, args.reps // 3), args.iters)
        print(
            f"{T:>5} {12:>3} {mean_doc:>8} {r['n_docs']:>5} {r['plain_ms']:>9.1f} {r['documents_ms']:>9.1f} "
            f"{r['ratio']:>7.3f} {r['cpu_ratio']:>9.3f}"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
