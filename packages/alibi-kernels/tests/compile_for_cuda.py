"""Compile the Triton kernels for a CUDA target without a GPU (Triton's frontend and its bundled ptxas).

The interpreter accepts code that the compiler rejects (for example a variable that changes type inside a runtime
`if`); this catches that class of error on a CPU-only machine. Run with TRITON_INTERPRET unset:

    python tests/compile_for_cuda.py [--arch 90] [--full]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_cuda.py needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from alibi_kernels.triton_backward import alibi_bwd_dkdv_kernel, alibi_bwd_dq_kernel  # noqa: E402
from alibi_kernels.triton_forward import alibi_fwd_kernel  # noqa: E402

POINTERS = {"Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"}
FP32_POINTERS = {"Slopes", "Lse", "Delta", "DSlope"}
INT32_POINTERS = {"CuSeqlens"}
FLOATS = {"qk_scale", "sm_scale"}


def signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name in POINTERS:
            sig[name] = f"*{dtype}"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in INT32_POINTERS:
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
    return sig


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--full", action="store_true", help="every dtype x head dim x causality, not a covering set")
    parser.add_argument("--varlen-only", action="store_true", help="only the packed-document (VARLEN) variants")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    if args.full:
        cases = list(itertools.product(["fp16", "bf16", "fp32"], [64, 80, 128, 256], [True, False], [False, True]))
    else:  # every kernel once per dtype; padded and unpadded head dims; both causal branches; packed documents
        cases = [("fp16", 80, True, False), ("bf16", 128, False, False), ("fp32", 64, True, False)]
        cases += [("bf16", 80, True, True)]
    if args.varlen_only:
        cases = [case for case in cases if case[3]]
    kernels = [(alibi_fwd_kernel, {}), (alibi_bwd_dkdv_kernel, {}), (alibi_bwd_dq_kernel, {"SLOPE_GRAD": True})]
    failures = 0
    for (fn, extra), (dtype, d, causal, varlen) in itertools.product(kernels, cases):
        constexprs = {
            "HEAD_DIM": d,
            "BLOCK_D": triton.next_power_of_2(d),
            "BLOCK_M": 64,
            "BLOCK_N": 32 if dtype == "fp32" else 64,
            "IS_CAUSAL": causal,
            "UPCAST": False,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "VARLEN": varlen,
            **extra,
        }
        src = ASTSource(fn=fn, signature=signature(fn, dtype, constexprs), constexprs=constexprs)
        try:
            compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 2})
            shared = compiled.metadata.shared
            print(f"ok   {fn.__name__} {dtype} D={d} causal={causal} varlen={varlen} shared={shared} B")
        except Exception as exc:  # report every failing kernel, not only the first
            failures += 1
            print(f"FAIL {fn.__name__} {dtype} D={d} causal={causal} varlen={varlen}: {type(exc).__name__}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
