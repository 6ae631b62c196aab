"""Ahead-of-time fit report: every tile config `launch_configs` returns, compiled for sm_80, sm_86, sm_89 and sm_90
without a GPU (Triton's frontend and its bundled ptxas), with shared memory, registers and spills.

    python packages/alibi-kernels/benchmarks/fit_report.py [--grid ci|full] [--workers N] [--check]
    python packages/alibi-kernels/benchmarks/fit_report.py --write-table [--workers N]

One row per (kernel, dtype, head dim, config); one column per target: shared bytes / registers / spill-store bytes,
"-" where the config does not fit that target (launch_configs leaves it out). --check exits 1 when a returned config
exceeds its target's shared memory, compiles to more shared memory than shared_memory.json says, or spills more
than its budget (launch_configs.spill_budget). --write-table recompiles every candidate of every kernel for the
sm_80-89 family (as sm_86) and for sm_90, bf16 (fp32) causal dense launches, and writes their shared bytes to
src/alibi_kernels/shared_memory.json; --every-variant also compiles fp16, non-causal, packed-document and
slope-gradient launches and keeps the largest (on 12 sampled configs every variant compiled to the same bytes).
Compiles are cached (alibi_kernels.compile_fit.fit_cache_dir). Needs TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("fit_report.py: error: TRITON_INTERPRET is set; interpreted kernels cannot be compiled: unset it")

import torch  # noqa: E402
import triton  # noqa: E402

from alibi_kernels.compile_fit import FIT_GRIDS, compile_fit, fit_cache_dir, fit_rows, kernel_launches  # noqa: E402
from alibi_kernels.launch_configs import (  # noqa: E402
    GPU_TARGETS,
    KERNELS,
    candidate_configs,
    table_key,
)

TABLE = Path(__file__).resolve().parents[1] / "src" / "alibi_kernels" / "shared_memory.json"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
FAMILIES = {"sm80": (8, 6), "sm90": (9, 0)}  # sm_80..sm_89 share one Triton GPU IR: compiled as sm_86


def report(grid_name: str, workers: int) -> int:
    grid = FIT_GRIDS[grid_name]
    start = time.perf_counter()
    rows = fit_rows(grid, workers)
    seconds = time.perf_counter() - start
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"grid {grid.name}: dtypes {', '.join(DTYPE_NAMES[d] for d in grid.dtypes)}; head dims "
        f"{', '.join(map(str, grid.head_dims))}; kernels {', '.join(KERNELS)}; every config launch_configs returns "
        f"for each target; Triton {triton.__version__}; compiled as "
        + ", ".join(f"{t} -> sm_{c[0]}{c[1]}" for t, (c, _) in grid.compiled_as.items())
    )
    print("cell: shared bytes / registers / spill-store bytes; '-': the config does not fit that target\n")
    targets = list(GPU_TARGETS)
    cells: dict[tuple, dict[str, str]] = {}
    budgets: dict[tuple, dict[str, int]] = {}
    problems = []
    for row in rows:
        key = (row.kernel, DTYPE_NAMES[row.dtype], row.head_dim, str(row.config))
        f = row.fit
        cells.setdefault(key, {})[row.target] = f"{f.shared_bytes} / {f.registers} / {f.spill_stores}"
        budgets.setdefault(key, {})[row.target] = row.spill_budget
        problems += [f"{' '.join(map(str, key))} on {row.target}: {p}" for p in row.problems()]
    limits = " | ".join(f"{t} ({GPU_TARGETS[t][1]} B)" for t in targets)
    print(f"| kernel | dtype | D | config | {limits} | spill budget |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in targets) + " | --- |")
    for key, by_target in cells.items():
        kernel, dtype, d, config = key
        line = " | ".join(by_target.get(t, "-") for t in targets)
        budget = sorted(set(budgets[key].values()))  # one number, or one per target where they differ (sm_80)
        budget_cell = str(budget[0]) if len(budget) == 1 else " / ".join(str(budgets[key].get(t, "-")) for t in targets)
        print(f"| {kernel} | {dtype} | {d} | {config} | {line} | {budget_cell} |")
    compiles = len({(r.kernel, r.dtype, r.head_dim, r.config, r.compiled_as) for r in rows})
    print(f"\n{len(rows)} (target, config) rows from {compiles} compiles in {seconds:.0f} s, {workers} worker(s)")
    print(f"compile cache: {fit_cache_dir()}")
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"fit check: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'passed'}")
    return 1 if problems else 0


def _variants(kernel: str, element_bytes: int, every: bool) -> list[tuple[torch.dtype, dict]]:
    """The launches one table entry stands for: bf16 (or fp32), causal, dense; with `every`, also fp16, non-causal,
    packed documents and the slope gradient (the table then keeps the largest)."""
    base = torch.bfloat16 if element_bytes == 2 else torch.float32
    if not every:
        return [(base, {})]
    dtypes = [torch.float16, torch.bfloat16] if element_bytes == 2 else [torch.float32]
    options = [{}, {"causal": False}, {"varlen": True}] + ([{"slope_grad": True}] if kernel == "dq" else [])
    return [(dtype, option) for dtype in dtypes for option in options]


def _table_job(job: tuple) -> int:
    kernel, dtype, option, d_class, config, capability = job
    launch = kernel_launches(dtype, d_class, **option)[kernel]
    return compile_fit(launch, config, capability, ptxas=False).shared_bytes


def write_table(workers: int, every_variant: bool) -> int:
    jobs, keys = [], []
    for kernel in KERNELS:
        for element_bytes, dtype in ((2, torch.bfloat16), (4, torch.float32)):
            for d_class in (64, 128, 256):
                for config in candidate_configs(kernel, dtype, d_class):
                    for family, capability in FAMILIES.items():
                        key = table_key(kernel, config, element_bytes, d_class, family)
                        for variant_dtype, option in _variants(kernel, element_bytes, every_variant):
                            jobs.append((kernel, variant_dtype, tuple(option.items()), d_class, config, capability))
                            keys.append(key)
    jobs = [(k, dt, dict(o), d, c, cap) for k, dt, o, d, c, cap in jobs]
    start = time.perf_counter()
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            shared = list(pool.map(_table_job, jobs))
    else:
        shared = [_table_job(job) for job in jobs]
    table: dict[str, int] = {}
    for key, nbytes in zip(keys, shared, strict=True):
        table[key] = max(table.get(key, 0), nbytes)
    variants = (
        "the largest over fp16/bf16, causal or not, packed documents and the slope gradient"
        if every_variant
        else "bf16 (fp32), causal, dense batches"
    )
    document = {
        "comment": (
            f"Shared memory per block of every candidate tile ({variants}), compiled without a GPU by "
            "benchmarks/fit_report.py --write-table. Key: kernel, family (sm80 = sm_80..sm_89, compiled as sm_86; "
            "sm90), bytes per element, head-dim class (compiled at its widest head dim), BLOCK_M x BLOCK_N, warps, "
            "stages."
        ),
        "triton": triton.__version__,
        "shared_bytes": dict(sorted(table.items())),
    }
    TABLE.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(table)} entries from {len(jobs)} compiles to {TABLE} in {time.perf_counter() - start:.0f} s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(FIT_GRIDS), default="ci", help="which launches to compile")
    parser.add_argument("--workers", type=int, default=1, help="compile processes (default 1)")
    parser.add_argument("--check", action="store_true", help="exit 1 when any row fails the fit check")
    parser.add_argument("--write-table", action="store_true", help="regenerate src/alibi_kernels/shared_memory.json")
    parser.add_argument(
        "--every-variant",
        action="store_true",
        help="with --write-table: compile fp16, non-causal, packed and slope-gradient variants too and keep the max",
    )
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.write_table:
        return write_table(args.workers, args.every_variant)
    rc = report(args.grid, args.workers)
    return rc if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
