"""Benchmark ALiBi attention; prints a table with ratios measured in the same run (never asserts on time).

GPU (CUDA visible): this package's Triton kernels vs PyTorch SDPA with the ALiBi bias as a float mask vs
FlexAttention with an ALiBi score_mod (vs flash-attn's alibi_slopes if installed); B=4, H=16, bf16, causal,
D in {64, 128}, T in {512, ..., 8192}; forward and forward+backward TFLOP/s with causal FLOPs
2*B*H*T^2*D (forward) and 3.5x that (forward+backward), peak memory, and beside each timing the method's max error
against float64 (output, and the worst of dq, dk, dv).

CPU: the torch path vs naive materialised attention (fp32), forward and forward+backward time and peak RSS growth,
B=2, H=8, D=64, T in 64..1024. Each (method, T) runs in a fresh subprocess so its peak memory is its own.
Then packed documents: `alibi_attention_varlen` (torch path) vs padding every document to max_seqlen and calling
`alibi_attention` (the padding and unpadding copies count), forward+backward time.

    python packages/alibi-kernels/benchmarks/bench_attention.py [--quick] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from alibi_kernels import alibi_attention, alibi_attention_reference, alibi_attention_varlen, alibi_bias, alibi_slopes


def causal_flops(b: int, h: int, t: int, d: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of causal attention: 4*b*h*t^2*d halved, and 3.5x that."""
    fwd = 2.0 * b * h * t * t * d
    return fwd, 3.5 * fwd


# ---------------------------------------------------------------- CPU: torch path vs naive materialised attention
CPU_B, CPU_H, CPU_D = 2, 8, 64


def _cpu_method(name: str):
    if name == "torch-path":
        return lambda q, k, v, s: alibi_attention(q, k, v, s, backend="torch")
    return lambda q, k, v, s: alibi_attention_reference(q, k, v, s, compute_dtype=torch.float32)


def _time(fn, min_reps: int = 5, min_seconds: float = 0.5) -> float:
    """Fastest of several calls, in seconds: the minimum is the least disturbed by other processes on a shared CPU."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return min(times)


def cpu_worker(name: str, t: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(CPU_B, CPU_H, t, CPU_D, requires_grad=True) for _ in range(3))
    do = torch.randn(CPU_B, CPU_H, t, CPU_D)
    slopes = alibi_slopes(CPU_H)
    fn = _cpu_method(name)
    small = [x.detach()[:, :, :16].clone().requires_grad_(True) for x in (q, k, v)]
    fn(*small, slopes).sum().backward()  # one-time start-up (thread pools, autograd engine) is not the method's
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # high-water mark so far (inputs, imports)

    def fwd_bwd():
        fn(q, k, v, slopes).backward(do)

    fwd_bwd()  # first call: the peak of one forward+backward, including the torch path's cached bias
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 1024
    with torch.no_grad():
        fwd_s = _time(lambda: fn(q, k, v, slopes))
    fwd_bwd_s = _time(fwd_bwd)
    return {"fwd_ms": fwd_s * 1e3, "fwd_bwd_ms": fwd_bwd_s * 1e3, "peak_mib": peak_mib}


def run_cpu(quick: bool, threads: int) -> None:
    ts = [64, 256, 1024] if quick else [64, 128, 256, 512, 1024]
    print(f"CPU, fp32, causal, B={CPU_B} H={CPU_H} D={CPU_D}, torch {torch.__version__}, {threads} thread(s)")
    print("time: fastest of >= 5 calls; peak: growth of max RSS over one forward+backward, fresh process per cell")
    header = f"{'T':>5} | {'method':<10} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'peak MiB':>8}"
    print(header + f" | {'fwd speedup':>11} | {'f+b speedup':>11} | {'mem ratio':>9}")
    print("-" * (len(header) + 42))
    for t in ts:
        res = {}
        for name in ("naive", "torch-path"):
            out = subprocess.run(
                [sys.executable, __file__, "--cpu-worker", name, str(t), "--threads", str(threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        for name in ("naive", "torch-path"):
            r = res[name]
            line = f"{t:>5} | {name:<10} | {r['fwd_ms']:>8.2f} | {r['fwd_bwd_ms']:>10.2f} | {r['peak_mib']:>8.1f}"
            if name == "torch-path":
                n = res["naive"]
                mem = n["peak_mib"] / r["peak_mib"] if r["peak_mib"] > 0 else float("inf")
                line += f" | {n['fwd_ms'] / r['fwd_ms']:>10.2f}x | {n['fwd_bwd_ms'] / r['fwd_bwd_ms']:>10.2f}x"
                line += f" | {mem:>8.2f}x"
            print(line)
    print("speedup and mem ratio: naive / torch path (> 1 means the torch path is faster or smaller)")


# ---------------------------------------------------------------- CPU: packed documents vs padding to max_seqlen
VARLEN_DOCS = [37, 512, 90, 1024, 5, 300, 64, 700]  # mixed lengths, as packed pretraining or chat data gives


def _padded_attention(q, k, v, cu: list[int], max_len: int, slopes):
    """Pad each document to max_len (right padding: causal rows never see the padding), attend, unpad."""
    docs = list(zip(cu[:-1], cu[1:], strict=True))

    def pad(t):  # (total, H, D) -> (N, H, max_len, D)
        out = t.new_zeros(len(docs), t.shape[1], max_len, t.shape[2])
        for i, (a, b) in enumerate(docs):
            out[i, :, : b - a] = t[a:b].transpose(0, 1)
        return out

    o = alibi_attention(pad(q), pad(k), pad(v), slopes, backend="torch")  # (N, H, max_len, D)
    return torch.cat([o[i, :, : b - a].transpose(0, 1) for i, (a, b) in enumerate(docs)])  # (total, H, D)


def run_cpu_varlen(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cu_list = [0, *torch.tensor(VARLEN_DOCS).cumsum(0).tolist()]
    cu, total, max_len = torch.tensor(cu_list), cu_list[-1], max(VARLEN_DOCS)
    q, k, v = (torch.randn(total, CPU_H, CPU_D, requires_grad=True) for _ in range(3))
    do = torch.randn(total, CPU_H, CPU_D)
    slopes = alibi_slopes(CPU_H)
    methods = {
        "padded": lambda: _padded_attention(q, k, v, cu_list, max_len, slopes),
        "varlen": lambda: alibi_attention_varlen(q, k, v, cu, max_len, slopes, backend="torch"),
    }
    diff = (methods["padded"]() - methods["varlen"]()).abs().max().item()
    times = {}
    for name, fn in methods.items():
        with torch.no_grad():
            fwd = _time(fn)
        times[name] = (fwd, _time(lambda fn=fn: fn().backward(do)))
    print(f"\npacked documents {VARLEN_DOCS} ({total} tokens, max {max_len}), fp32, causal, H={CPU_H} D={CPU_D}")
    print(f"{'method':<8} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'fwd speedup':>11} | {'f+b speedup':>11}")
    for name, (fwd, fb) in times.items():
        line = f"{name:<8} | {fwd * 1e3:>8.2f} | {fb * 1e3:>10.2f}"
        if name == "varlen":
            pf, pfb = times["padded"]
            line += f" | {pf / fwd:>10.2f}x | {pfb / fb:>10.2f}x"
        print(line)
    print(f"speedup: padded / varlen (> 1 means varlen is faster); max |padded - varlen| = {diff:.1e}")


# ---------------------------------------------------------------- GPU: Triton vs SDPA mask vs FlexAttention
GPU_B, GPU_H = 4, 16


def _gpu_methods(q, k, v, slopes):
    """name -> setup() returning (forward closure, leaves to clear); setup builds persistent buffers (masks), so
    they count in the method's peak memory."""
    t = q.shape[2]

    def ours_setup():
        return (lambda: alibi_attention(q, k, v, slopes, backend="triton")), (q, k, v)

    def sdpa_setup():
        mask = alibi_bias(slopes[None], t, t, causal=True, dtype=q.dtype, device=q.device)  # (1, H, T, T)
        return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)), (q, k, v)

    methods = {"alibi-kernels": ours_setup, "sdpa-mask": sdpa_setup}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

        def flex_setup():
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)

            block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t, device=q.device)
            return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)), (q, k, v)

        methods["flex-attention"] = flex_setup
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func

        def fa_setup():
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))  # (B,T,H,D)
            return (lambda: flash_attn_func(qt, kt, vt, causal=True, alibi_slopes=slopes).transpose(1, 2)), (qt, kt, vt)

        methods["flash-attn"] = fa_setup
    except ImportError:
        pass
    return methods


def _measure_gpu(setup, do):
    """(output and gradients of one forward+backward as fp32, forward ms, forward+backward ms, peak GiB)."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    fn, leaves = setup()
    persistent = torch.cuda.memory_allocated() - before  # e.g. the SDPA float mask
    fn().backward(do)  # warm-up: compilation and autotuning stay out of the peak
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    out.backward(do)
    torch.cuda.synchronize()
    peak = (persistent + torch.cuda.max_memory_allocated() - start) / 2**30
    # (B, H, T, D) like the output: flash-attn's leaves are (B, T, H, D)
    grads = [g if g.shape == out.shape else g.transpose(1, 2) for g in (leaf.grad for leaf in leaves)]
    results = [out.detach().float()] + [g.detach().float() for g in grads]
    with torch.no_grad():
        fwd_ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    fb_ms = do_bench(lambda: fn().backward(do), warmup=25, rep=100, grad_to_none=list(leaves), return_mode="median")
    return results, fwd_ms, fb_ms, peak


def _float64_reference(q, k, v, slopes, do):
    """Output and (dq, dk, dv) in float64, a few heads at a time so the (T x T) scores stay within a few GiB."""
    b, h, t, _ = q.shape
    heads = max(1, min(h, (2 * 2**30) // (8 * b * t * t)))
    outs, grads = [], [[], [], []]
    for start in range(0, h, heads):
        part = slice(start, start + heads)
        leaves = [x.detach()[:, part].double().requires_grad_(True) for x in (q, k, v)]
        out = alibi_attention_reference(*leaves, slopes[part], causal=True)
        out.backward(do[:, part].double())
        outs.append(out.detach())
        for acc, leaf in zip(grads, leaves, strict=True):
            acc.append(leaf.grad)
        del out, leaves
    return [torch.cat(outs, 1)] + [torch.cat(g, 1) for g in grads]


def _max_error(results, reference) -> tuple[float, float]:
    """(max |out - float64|, max over dq, dk, dv of max |grad - float64|)."""
    errors = [(r.double() - ref).abs().max().item() for r, ref in zip(results, reference, strict=True)]
    return errors[0], max(errors[1:])


def run_gpu(quick: bool) -> None:
    ts = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192]
    ds = [128] if quick else [64, 128]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"GPU {torch.cuda.get_device_name()}, bf16, causal, B={GPU_B} H={GPU_H}, torch {torch.__version__}")
    print("TFLOP/s: causal FLOPs 2*B*H*T^2*D forward (4*B*H*T^2*D halved), 3.5x that for forward+backward; median of")
    print("triton.testing.do_bench after a warm-up call. Peak GiB: persistent buffers (the SDPA mask) plus the extra")
    print("memory of one forward+backward, gradients included. out err, grad err: max |x - float64| of the output and")
    print("of dq, dk, dv (the worst), each method on the same bf16 inputs; float64 is the materialised reference.\n")
    print("| D | T | method | fwd TFLOP/s | fwd+bwd TFLOP/s | peak GiB | out err | grad err | fwd+bwd vs flex |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ours: dict[tuple[int, int], tuple[float, float, float | None]] = {}
    for d in ds:
        for t in ts:
            torch.manual_seed(0)
            q, k, v = (torch.randn(GPU_B, GPU_H, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            q, k, v = (x.requires_grad_(True) for x in (q, k, v))
            do = torch.randn_like(q)
            slopes = alibi_slopes(GPU_H).cuda()
            fwd_flops, fb_flops = causal_flops(GPU_B, GPU_H, t, d)
            rows = {}
            reference = _float64_reference(q, k, v, slopes, do)
            for name, setup in _gpu_methods(q, k, v, slopes).items():
                try:
                    result = _measure_gpu(setup, do)
                except Exception as exc:  # one failing baseline (OOM, compile error) must not hide the others
                    print(f"| {d} | {t} | {name} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} |")
                    for leaf in (q, k, v):
                        leaf.grad = None
                    torch.cuda.empty_cache()
                    continue
                results, fwd_ms, fb_ms, peak = result
                out_err, grad_err = _max_error(results, reference)
                rows[name] = (fwd_flops / fwd_ms / 1e9, fb_flops / fb_ms / 1e9, peak, out_err, grad_err)
                del results
            del reference
            flex_fb = rows.get("flex-attention", (None, None))[1]
            for name, (fwd_tf, fb_tf, peak, out_err, grad_err) in rows.items():
                vs = f"{fb_tf / flex_fb:.2f}x" if flex_fb else "n/a"
                errors = f"{out_err:.2e} | {grad_err:.2e}"
                print(f"| {d} | {t} | {name} | {fwd_tf:.1f} | {fb_tf:.1f} | {peak:.2f} | {errors} | {vs} |")
            if "alibi-kernels" in rows:
                ours[(d, t)] = (rows["alibi-kernels"][0], rows["alibi-kernels"][1], flex_fb)
    print()
    for (d, t), (fwd_tf, fb_tf, flex_fb) in ours.items():
        verdicts = []
        if d == 128 and t >= 4096:
            verdicts.append(f"forward {fwd_tf:.0f} TFLOP/s vs goal >= 300: {'met' if fwd_tf >= 300 else 'NOT met'}")
        if flex_fb:
            verdicts.append(f"fwd+bwd {fb_tf / flex_fb:.2f}x FlexAttention: {'met' if fb_tf >= flex_fb else 'NOT met'}")
        print(f"D={d} T={t}: " + ("; ".join(verdicts) if verdicts else "no goal applies (FlexAttention failed)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--cpu", action="store_true", help="run the CPU table even when CUDA is visible")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: spinning OpenMP threads on a shared machine "
        "turn every parallel region into a wait for a descheduled core)",
    )
    parser.add_argument("--cpu-worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_worker:
        print(json.dumps(cpu_worker(args.cpu_worker[0], int(args.cpu_worker[1]), args.threads)))
        return
    start = time.perf_counter()
    if torch.cuda.is_available() and not args.cpu:
        run_gpu(args.quick)
    else:
        run_cpu(args.quick, args.threads)
        run_cpu_varlen(args.threads)
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
