"""GPU check for alibi-kernels: the gpu-marked tests, then the benchmark table.

Run from the repository root with alibi-kernels importable (installed, or its src/ on PYTHONPATH):

    python tools/gpu_check_kernels.py                  # full test grid + full benchmark (CUDA host)
    python tools/gpu_check_kernels.py --quick          # quick grid + quick benchmark (what tools/gpu_check.sh runs)
    python tools/gpu_check_kernels.py --quick --dry-run          # what would run, on any machine
    python tools/gpu_check_kernels.py --quick --count-compiles   # Triton compilations the test grid needs (CPU)

The tests run with ALIBI_KERNELS_AUTOTUNE=0 (each kernel launches its first config: one compilation per
specialisation instead of one per candidate config) and, where pytest-xdist is installed, in --workers processes,
so compilations (CPU-bound, one core each) run side by side on the one GPU. The benchmark keeps autotuning on: its
figures are the tuned kernels'. --count-compiles binds every launch of the two parametrised grids
(tests/test_gpu_grid.py and the packed-document grid) with Triton's own argument specialisation for an sm_90
target, on CPU tensors and without compiling, and prints how many distinct kernels that makes.

Exits 2 with one line when CUDA is absent (unless --dry-run or --count-compiles), 1 when a part fails, 124 when a
part hits --timeout (the whole process group is killed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packages" / "alibi-kernels"
TESTS = PACKAGE / "tests"


def _parts(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    """(title, command, extra environment) of each part to run."""
    parts = []
    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", str(TESTS), "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        cmd += ["--durations=15", "-rfE"]
        if args.workers > 1:  # cases marked with one xdist_group share kernels: one worker compiles them once
            cmd += ["-n", str(args.workers), "--dist", "loadgroup"]
        env = {"ALIBI_KERNELS_AUTOTUNE": "0", "ALIBI_KERNELS_GPU_GRID": "quick" if args.quick else "full"}
        parts.append(("gpu tests", cmd, env))
    if not args.skip_bench:
        cmd = [sys.executable, str(PACKAGE / "benchmarks" / "bench_attention.py")] + (["--quick"] if args.quick else [])
        parts.append(("benchmark", cmd, {}))
    return parts


def _run(title: str, cmd: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run one part in its own process group; on timeout the whole group (pytest-xdist workers too) is killed."""
    print(f"\n=== {title} (limit {timeout_s:g} s): {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"=== {title}: timed out after {timeout_s:g} s, process group killed", flush=True)
        return 124
    print(f"=== {title}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
    return rc


# ---------------------------------------------------------------- --count-compiles (CPU, no GPU needed)
class _Recorder:
    """Stands in for `attention_triton._kernel`: binds each launch's arguments the way Triton does before it
    compiles (ints equal to 1 become constants, ints and pointers divisible by 16 are marked so) for an sm_90
    target, and records the resulting compile key instead of launching anything."""

    def __init__(self, attention_triton) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.at = attention_triton
        backend = make_backend(GPUTarget("cuda", 90, 32))
        raw = {
            "fwd": attention_triton.alibi_fwd_kernel,
            "dkdv": attention_triton.alibi_bwd_dkdv_kernel,
            "dq": attention_triton.alibi_bwd_dq_kernel,
        }
        self.binders = {
            name: create_function_from_signature(fn.signature, fn.params, backend) for name, fn in raw.items()
        }
        self.keys: set[tuple] = set()
        self.launches = 0

    def __call__(self, name: str, block_d: int) -> _Recorder._Launch:
        return _Recorder._Launch(self, name, block_d)

    class _Launch:
        def __init__(self, recorder: _Recorder, name: str, block_d: int) -> None:
            self.recorder, self.name, self.block_d = recorder, name, block_d

        def __getitem__(self, grid):
            return self.launch

        def launch(self, *args, **kwargs) -> None:
            rec = self.recorder
            rec.launches += 1
            if kwargs.get("BLOCK_M") is None:  # autotuned: every candidate config is compiled
                configs = rec.at._configs(self.name, self.block_d)
                variants = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]
            else:
                variants = [{}]
            for extra in variants:
                _, spec, options = rec.binders[self.name](*args, **{**kwargs, **extra})
                rec.keys.add((self.name, tuple(spec), tuple(sorted(options.items()))))


def count_compiles(quick: bool) -> int:
    """Distinct compiled kernels the gpu-marked grids launch (autotuning off), counted on CPU."""
    os.environ["ALIBI_KERNELS_AUTOTUNE"] = "0"
    os.environ["ALIBI_KERNELS_GPU_GRID"] = "quick" if quick else "full"
    sys.path.insert(0, str(TESTS))
    import attention_cases
    import test_attention_varlen
    import test_gpu_grid

    import alibi_kernels.attention_triton as at
    from alibi_kernels.validation import check_attention_inputs, check_varlen_inputs

    at.INTERPRETED = False  # launch options as on CUDA
    recorder = _Recorder(at)
    at._kernel = recorder

    def dense(q, k, v, s, *, causal):
        _, slopes_2d, scale = check_attention_inputs(q, k, v, s, causal, None)
        return at._AlibiAttention.apply(q, k, v, slopes_2d, causal, scale)

    for case in test_gpu_grid.GRID:
        q, k, v, do, slopes = test_gpu_grid.grid_inputs(*case, device="cpu")
        attention_cases.forward_backward(dense, q, k, v, do, slopes, causal=case[3])
    grid_keys = len(recorder.keys)
    for case in test_attention_varlen.GPU_GRID:
        q, k, v, do, slopes, cu = test_attention_varlen.gpu_varlen_inputs(*case, device="cpu")
        shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu, None, slopes, None)

        def packed(q, k, v, s, *, causal, cu=cu, shape=shape, slopes_2d=slopes_2d, scale=scale):
            return at._AlibiAttention.apply(q, k, v, slopes_2d, causal, scale, cu, shape.max_seqlen)

        attention_cases.forward_backward(packed, q, k, v, do, slopes, causal=case[3])
    by_kernel = {name: sum(key[0] == name for key in recorder.keys) for name in ("fwd", "dkdv", "dq")}
    print(
        f"grid {'quick' if quick else 'full'}: {len(test_gpu_grid.GRID)} dense cases + "
        f"{len(test_attention_varlen.GPU_GRID)} packed cases, {recorder.launches} kernel launches, "
        f"{len(recorder.keys)} distinct compilations ({grid_keys} for the dense grid; "
        + ", ".join(f"{n} {c}" for n, c in by_kernel.items())
        + ")"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick test grid (144 + 16 cases) and benchmark sweep")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    parser.add_argument("--skip-bench", action="store_true", help="only the tests")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per part (default 1800)")
    default_workers = min(8, os.cpu_count() or 1) if importlib.util.find_spec("xdist") else 1
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers,
        help=f"pytest-xdist processes for the tests (default here: {default_workers}; 1 without pytest-xdist)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the parts and commands, run nothing")
    parser.add_argument(
        "--count-compiles", action="store_true", help="count the Triton compilations of the test grids (on CPU)"
    )
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.workers > 1 and not importlib.util.find_spec("xdist") and not args.dry_run:
        parser.error(f"--workers {args.workers} needs pytest-xdist, which is not installed; use --workers 1")
    if args.count_compiles:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            parser.error("--count-compiles binds compiled kernels: unset TRITON_INTERPRET")
        return count_compiles(args.quick)
    parts = _parts(args)
    if args.dry_run:
        for title, cmd, extra in parts:
            env_text = " ".join(f"{k}={v}" for k, v in extra.items())
            print(f"{title} (limit {args.timeout:g} s): {env_text + ' ' if env_text else ''}{' '.join(cmd)}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_check_kernels: CUDA is not available to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda}); run this on a host with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    base_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    results = [_run(title, cmd, {**base_env, **extra}, args.timeout) for title, cmd, extra in parts]
    if 124 in results:
        return 124
    return 1 if any(results) else 0


if __name__ == "__main__":
    sys.exit(main())
