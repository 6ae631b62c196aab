"""A cpu-small training step with each CPU lever on and off, as MFU against the machine's measured FMA peak, and per
FLOP against nanoGPT's same-width model.

A step is forward, backward, fused AdamW and zero_grad on random ids (B=16, T=128: cpu-small's recipe). Variants
alternate inside each repetition (the first one rotates), each timed over --iters steps; figures are medians of this
process's CPU time over repetitions (what other processes' load inflates least), ratios medians of paired
per-repetition ratios against "fp32" (MKL, eager). The levers: "onednn" (fp32 GEMMs on oneDNN: timed only where
lmcore.cpu_math's probe finds oneDNN's results fp32, or with --force-routing), "bf16" (autocast), "compile"
(lmcore.compiled.compile_model, inductor), and their combination.

FLOPs per step are PaLM's 6*N + 12*L*H*Q*T per token (lmcore.flops_per_token); GFLOP/s per core divide by CPU
seconds (all threads), so 1 and 2 threads read on one scale. MFU divides that by the per-core peak of an AVX-512
fp32 FMA loop (12 independent chains of 16-wide FMAs, compiled here with the system C compiler; a 2048^3 fp32
matmul is printed beside it). nanoGPT's model is written out below (its model.py's shape: learned positions, fused
qkv, biases, tied head, causal SDPA); it trains its "baby" configuration (4 layers, 4 heads, width 128, T=64, B=12,
65 characters) and, for the same-shape row, lmcore's.

    python benchmarks/bench_step.py [--threads 1 2] [--reps 7] [--iters 3] [--no-compile] [--force-routing]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmcore import GPT, ModelConfig, flops_per_token
from lmcore.compiled import compile_model
from lmcore.cpu_math import cpu_has_native_bf16, model_gemm_shapes, probe_matmul_routing, set_cpu_matmul_library

FMA_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
/* 12 independent chains, more FMAs in flight than latency x ports: the loop is bound by FMA throughput. They start
   from distinct values: chains that start equal are merged by the compiler into one (one FMA per iteration). */
float fma_loop(int64_t iters) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(1.0f + i);
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int64_t n = 0; n < iters; n++) {
        a[0] = _mm512_fmadd_ps(a[0], m, c); a[1] = _mm512_fmadd_ps(a[1], m, c);
        a[2] = _mm512_fmadd_ps(a[2], m, c); a[3] = _mm512_fmadd_ps(a[3], m, c);
        a[4] = _mm512_fmadd_ps(a[4], m, c); a[5] = _mm512_fmadd_ps(a[5], m, c);
        a[6] = _mm512_fmadd_ps(a[6], m, c); a[7] = _mm512_fmadd_ps(a[7], m, c);
        a[8] = _mm512_fmadd_ps(a[8], m, c); a[9] = _mm512_fmadd_ps(a[9], m, c);
        a[10] = _mm512_fmadd_ps(a[10], m, c); a[11] = _mm512_fmadd_ps(a[11], m, c);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}
"""
FMA_FLOPS_PER_ITER = 12 * 16 * 2


def fma_peak_gflops(repeats: int = 5, iters: int = 20_000_000) -> float | None:
    """Per-core GFLOP/s of the AVX-512 FMA loop (median over repeats, process CPU time); None without a compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "fma.c", Path(tmp) / "fma.so"
        src.write_text(FMA_SOURCE)
        built = subprocess.run([cc, "-O2", "-mavx512f", "-shared", "-fPIC", str(src), "-o", str(lib)], check=False)
        if built.returncode != 0:
            return None
        fma = ctypes.CDLL(str(lib)).fma_loop
        fma.restype, fma.argtypes = ctypes.c_float, [ctypes.c_int64]
        fma(iters // 10)
        rates = []
        for _ in range(repeats):
            t0 = time.process_time()
            fma(iters)
            rates.append(iters * FMA_FLOPS_PER_ITER / (time.process_time() - t0) / 1e9)
    return statistics.median(rates)


def matmul_gflops(library: str, n: int = 2048, repeats: int = 5) -> float:
    set_cpu_matmul_library(library)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    rates = []
    for _ in range(repeats):
        t0 = time.process_time()
        a @ b
        rates.append(2 * n**3 / (time.process_time() - t0) / 1e9)
    set_cpu_matmul_library("mkl")
    return statistics.median(rates)


class NanoBlock(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.resid_drop(self.attn_proj(y))
        return x + self.resid_drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    """nanoGPT's model.py shape: token + learned position embeddings, pre-norm blocks with biases, tied head."""

    def __init__(self, vocab: int, n_layer: int, n_head: int, d: int, context: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_layer, self.n_head, self.d, self.context = n_layer, n_head, d, context
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(NanoBlock(d, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # nanoGPT's init: N(0, 0.02), zero biases, scaled residual outputs
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    def flops_per_token(self, seq_len: int) -> float:
        """The same convention as lmcore's: 6*N (the position table, a lookup, left out) + 12*L*H*Q*T."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * self.n_layer * self.d * seq_len


def make_step(model: nn.Module, B: int, T: int, vocab: int, *, bf16: bool = False, lmcore_model: bool = True):
    """One training step of `model` on fixed random ids: forward (autocast when bf16), backward, fused AdamW."""
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(idx, tgt)
            loss = out.loss if lmcore_model else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], None], iters: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    return (time.process_time() - cpu) / iters, (time.perf_counter() - wall) / iters


def alternate(variants: dict[str, tuple[Callable[[], None], str]], reps: int, iters: int) -> dict[str, dict]:
    """Per variant: median CPU and wall seconds per step, and the median of paired CPU ratios against the first."""
    for step, library in variants.values():  # warm-up: allocator, bias cache, oneDNN primitives, compilation
        set_cpu_matmul_library(library)
        timed(step, 2)
    names = list(variants)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        this = {}
        for name in order:
            step, library = variants[name]
            set_cpu_matmul_library(library)
            this[name] = timed(step, iters)
        set_cpu_matmul_library("mkl")
        for name in names:
            cpu[name].append(this[name][0])
            wall[name].append(this[name][1])
            ratios[name].append(this[names[0]][0] / this[name][0])
    return {
        n: {"cpu": statistics.median(cpu[n]), "wall": statistics.median(wall[n]), "ratio": statistics.median(ratios[n])}
        for n in names
    }


def lmcore_model(config: ModelConfig, compiled: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    return compile_model(model) if compiled else model


def print_table(results: dict[str, dict], flops: dict[str, float], peak: float | None) -> None:
    print(f"{'variant':<16} {'CPU ms':>8} {'wall ms':>8} {'x fp32':>7} {'GFLOP/s/core':>13} {'MFU':>6}")
    for name, r in results.items():
        rate = flops[name] / r["cpu"] / 1e9
        mfu = f"{100 * rate / peak:5.1f}%" if peak else "   n/a"
        print(f"{name:<16} {1e3 * r['cpu']:>8.1f} {1e3 * r['wall']:>8.1f} {r['ratio']:>7.3f} {rate:>13.1f} {mfu:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    parser.add_argument("--force-routing", action="store_true", help="time oneDNN even where its results are not fp32")
    args = parser.parse_args()
    B, T = args.batch, args.seq_len
    config = ModelConfig.from_preset("cpu-small", context_length=T)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"native bf16: {cpu_has_native_bf16()}, load average {os.getloadavg()[0]:.1f}"
    )
    torch.set_num_threads(1)
    peak = fma_peak_gflops()
    mkl_big = matmul_gflops("mkl")
    onednn_big = matmul_gflops("onednn")
    print(
        f"peak, one core: AVX-512 fp32 FMA loop {peak:.1f} GFLOP/s; 2048^3 fp32 matmul: MKL {mkl_big:.1f}, oneDNN "
        f"routed {onednn_big:.1f} GFLOP/s (its precision: see the probe below)"
        if peak
        else "peak: no C compiler for the FMA loop, MFU not printed"
    )
    step_flops = flops_per_token(config, T) * B * T
    print(f"cpu-small step: B={B} T={T}, {step_flops / 1e9:.2f} GFLOP (6N + 12LHQT per token)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
        probe = probe_matmul_routing(model_gemm_shapes(config, B * T), record_kernels=True)
        print(
            f"\n--threads {threads}: routing probe: {probe.reason}; oneDNN kernels {', '.join(probe.kernels)}; "
            f"MKL {probe.mkl_gflops:.0f} vs oneDNN {probe.onednn_gflops:.0f} GFLOP/s, errors {probe.mkl_error:.1e} "
            f"vs {probe.onednn_error:.1e}; probe {probe.probe_s:.2f} CPU s ({probe.wall_s:.1f} wall s)"
        )
        route = probe.routed or args.force_routing
        variants = {
            "fp32": (make_step(lmcore_model(config, False), B, T, config.vocab_size), "mkl"),
            "bf16": (make_step(lmcore_model(config, False), B, T, config.vocab_size, bf16=True), "mkl"),
        }
        if route:
            variants["onednn"] = (make_step(lmcore_model(config, False), B, T, config.vocab_size), "onednn")
        if not args.no_compile:
            t0, c0 = time.perf_counter(), time.process_time()
            compiled = lmcore_model(config, True)
            step = make_step(compiled, B, T, config.vocab_size)
            step()
            compiled_bf16 = lmcore_model(config, True)
            step_bf16 = make_step(compiled_bf16, B, T, config.vocab_size, bf16=True)
            step_bf16()
            spent = time.perf_counter() - t0, time.process_time() - c0
            print(f"compilation (fp32 and bf16): {spent[0]:.0f} s wall, {spent[1]:.0f} CPU s in this process")
            variants["compile"] = (step, "mkl")
            variants["compile+bf16"] = (step_bf16, "mkl")
        if route:
            best = variants["bf16" if args.no_compile else "compile+bf16"][0]
            variants["all levers"] = (best, "onednn")
        results = alternate(variants, args.reps, args.iters)
        print_table(results, {name: step_flops for name in results}, peak)
        print(f"load average {os.getloadavg()[0]:.1f}")

    torch.set_num_threads(1)
    print("\nper FLOP against nanoGPT (fp32, MKL, eager, one thread)")
    nano_cfg = dict(vocab=65, n_layer=4, n_head=4, d=128, context=64)
    torch.manual_seed(0)
    nano_baby, nano_same = NanoGPT(**nano_cfg), NanoGPT(**{**nano_cfg, "vocab": config.vocab_size, "context": T})
    lm_baby = lmcore_model(ModelConfig(vocab_size=65, n_layer=4, n_head=4, d_model=128, context_length=64), False)
    lm = lmcore_model(config, False)
    rows = {
        "nanoGPT baby": (make_step(nano_baby, 12, 64, 65, lmcore_model=False), 12 * 64, nano_baby.flops_per_token(64)),
        "lmcore cpu-small": (make_step(lm, B, T, config.vocab_size), B * T, flops_per_token(config, T)),
        "nanoGPT at lmcore's shape": (
            make_step(nano_same, B, T, config.vocab_size, lmcore_model=False),
            B * T,
            nano_same.flops_per_token(T),
        ),
        "lmcore at baby shape": (make_step(lm_baby, 12, 64, 65), 12 * 64, flops_per_token(lm_baby.config, 64)),
    }
    results = alternate({n: (r[0], "mkl") for n, r in rows.items()}, args.reps, args.iters)
    print(f"{'model':<26} {'CPU ms':>8} {'tokens/CPU s':>13} {'GFLOP/s/core':>13}")
    rate = {}
    for name, r in results.items():
        tokens, fpt = rows[name][1], rows[name][2]
        rate[name] = (tokens / r["cpu"], tokens * fpt / r["cpu"] / 1e9)
        print(f"{name:<26} {1e3 * r['cpu']:>8.1f} {rate[name][0]:>13.0f} {rate[name][1]:>13.1f}")
    lm_rate, nano_rate = rate["lmcore cpu-small"], rate["nanoGPT baby"]
    same_small = lm_rate[1] / rate["nanoGPT at lmcore's shape"][1]
    same_baby = rate["lmcore at baby shape"][1] / nano_rate[1]
    print(
        f"lmcore_vs_nanogpt_per_flop: {lm_rate[1] / nano_rate[1]:.3f} (per token {lm_rate[0] / nano_rate[0]:.3f}; "
        f"same shape, per FLOP: at nanoGPT's baby shape {same_baby:.3f}, at cpu-small's {same_small:.3f})"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
