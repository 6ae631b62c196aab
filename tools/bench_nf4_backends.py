"""NF4 on this machine's CPU: torchao's NF4Tensor against bitsandbytes' Linear4bit (nf4), whichever is importable.

For one frozen 4-bit linear layer of a small model's shape (d=256 -> 1024, 4096 input rows): whether forward and
backward (gradient of the input, as LoRA needs) run, the time of one forward+backward as a ratio to the same layer
in fp32 (measured in the same process), the bytes stored per weight and the largest error of the dequantized
weight relative to the largest weight. Prints one line per backend; never asserts on time.

    python tools/bench_nf4_backends.py
"""

from __future__ import annotations

import time

import torch


def best_of(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    linear = torch.nn.Linear(256, 1024, bias=False)
    w = linear.weight.detach()
    x = torch.randn(4096, 256, requires_grad=True)

    def fp32_step():
        torch.nn.functional.linear(x, w).sum().backward()

    base = best_of(fp32_step)
    print(f"fp32 linear: {base * 1e3:.2f} ms per forward+backward (the baseline)")
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

        nf4 = to_nf4(w, 64, 256)
        inner, _ = nf4.__tensor_flatten__()
        stored = sum(getattr(nf4, k).numel() * getattr(nf4, k).element_size() for k in inner)
        err = (nf4.get_original_weight() - w).abs().max() / w.abs().max()
        t = best_of(lambda: linear_nf4(x, nf4).sum().backward())
        print(
            f"torchao NF4: runs; {t / base:.2f}x fp32 time; {stored / w.numel():.3f} bytes/weight; "
            f"max error {err:.4f} of max |w|"
        )
    except Exception as exc:  # report, do not stop: the point is which one works here
        print(f"torchao NF4: fails: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(256, 1024, bias=False, quant_type="nf4", compute_dtype=torch.float32)
        layer.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4")
        layer = layer.to("cpu")
        layer(x[:2])  # quantizes on first use where the backend does it lazily
        q = layer.weight
        stored = q.data.numel() * q.data.element_size()
        deq = bnb.functional.dequantize_4bit(q.data, q.quant_state)
        err = (deq - w).abs().max() / w.abs().max()
        t = best_of(lambda: layer(x).sum().backward())
        print(
            f"bitsandbytes {bnb.__version__} Linear4bit nf4: runs; {t / base:.2f}x fp32 time; "
            f"{stored / w.numel():.3f} bytes/weight (codes only); max error {err:.4f} of max |w|"
        )
    except Exception as exc:
        print(f"bitsandbytes Linear4bit nf4: fails: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
