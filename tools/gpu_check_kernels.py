"""GPU check for alibi-kernels: the gpu-marked tests, then the benchmark table.

Run from the repository root with alibi-kernels importable (installed, or its src/ on PYTHONPATH):

    python tools/gpu_check_kernels.py                  # full test grid + full benchmark (CUDA host)
    python tools/gpu_check_kernels.py --quick          # quick grid + quick benchmark (tools/gpu_check.sh's grids)
    python tools/gpu_check_kernels.py --quick --dry-run          # what would run, on any machine
    python tools/gpu_check_kernels.py --quick --count-compiles   # Triton compilations the test grid needs (CPU)

The tests run with ALIBI_KERNELS_AUTOTUNE=0 (each kernel launches the first config that fits the GPU: one
compilation per specialisation instead of one per candidate config) and, where pytest-xdist is installed, in
--workers processes, so compilations (CPU-bound, one core each) run side by side on the one GPU. The benchmark
keeps autotuning on: its figures are the tuned kernels'. --count-compiles captures every launch of the two
parametrised grids (tests/test_gpu_grid.py and the packed-document grid) on CPU tensors, binds it with Triton's own
argument specialisation for an sm_90 target and the config the no-autotune path picks there, without compiling,
and prints how many distinct kernels that makes. tools/gpu_check.sh runs the same tests and benchmark as parts of
its own.

Exits 2 with one line when CUDA is absent (unless --dry-run or --count-compiles), 1 when a part fails, 124 when a
part hits --timeout. Each part runs in its own process group, killed at the timeout, when the part ends and when
this script is terminated.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _run(title: str, cmd: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run one part in its own process group. At the timeout, at the part's end (leftovers) and when this script is
    terminated (SIGTERM, SIGINT), the whole group is killed: pytest-xdist workers never outlive their part."""
    print(f"\n=== {title} (limit {timeout_s:g} s): {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)

    def on_signal(signum, frame):
        _kill_group(proc.pid)
        sys.exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
        print(f"=== {title}: timed out after {timeout_s:g} s, process group killed", flush=True)
        return 124
    finally:
        _kill_group(proc.pid)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"=== {title}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
    return rc


# ---------------------------------------------------------------- --count-compiles (CPU, no GPU needed)
def count_compiles(quick: bool) -> int:
    """Distinct compiled kernels the gpu-marked grids launch with autotuning off on an H100/H200, counted on CPU:
    every launch is captured (alibi_kernels.attention_triton.captured_launches), bound with Triton's own argument
    specialisation for sm_90, and given the config the no-autotune path picks there (the first that fits)."""
    os.environ["ALIBI_KERNELS_AUTOTUNE"] = "0"
    os.environ["ALIBI_KERNELS_GPU_GRID"] = "quick" if quick else "full"
    sys.path.insert(0, str(TESTS))
    import attention_cases
    import test_attention_varlen
    import test_gpu_grid
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    import alibi_kernels.attention_triton as at
    from alibi_kernels.launch_configs import GPU_TARGETS, launch_configs
    from alibi_kernels.validation import check_attention_inputs, check_varlen_inputs

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders = {k: create_function_from_signature(f.signature, f.params, backend) for k, f in at.RAW_KERNELS.items()}
    capability, smem = GPU_TARGETS["H100/H200 (sm_90)"]
    keys: set[tuple] = set()
    launches = 0

    def record(captured) -> None:
        nonlocal launches
        for launch in captured:
            launches += 1
            head_dim = launch.constants["HEAD_DIM"]
            config = launch_configs(
                launch.kernel, capability=capability, smem_per_block=smem, dtype=launch.dtype, head_dim=head_dim
            )[0]
            _, spec, options = binders[launch.kernel](*launch.args, **launch.constants, **config.launch_kwargs())
            keys.add((launch.kernel, tuple(spec), tuple(sorted(options.items()))))

    def dense(q, k, v, s, *, causal):
        _, slopes_2d, scale = check_attention_inputs(q, k, v, s, causal, None)
        return at.triton_call(q, k, v, slopes_2d, causal, scale)

    for case in test_gpu_grid.GRID:
        q, k, v, do, slopes = test_gpu_grid.grid_inputs(*case, device="cpu")
        with at.captured_launches() as captured:
            attention_cases.forward_backward(dense, q, k, v, do, slopes, causal=case[3])
        record(captured)
    grid_keys = len(keys)
    for case in test_attention_varlen.GPU_GRID:
        q, k, v, do, slopes, cu = test_attention_varlen.gpu_varlen_inputs(*case, device="cpu")
        shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu, None, slopes, None)

        def packed(q, k, v, s, *, causal, cu=cu, shape=shape, slopes_2d=slopes_2d, scale=scale):
            return at.triton_call(q, k, v, slopes_2d, causal, scale, cu, shape.max_seqlen)

        with at.captured_launches() as captured:
            attention_cases.forward_backward(packed, q, k, v, do, slopes, causal=case[3])
        record(captured)
    by_kernel = {name: sum(key[0] == name for key in keys) for name in at.RAW_KERNELS}
    print(
        f"grid {'quick' if quick else 'full'}: {len(test_gpu_grid.GRID)} dense cases + "
        f"{len(test_attention_varlen.GPU_GRID)} packed cases, {launches} kernel launches, "
        f"{len(keys)} distinct compilations ({grid_keys} for the dense grid; "
        + ", ".join(f"{n} {c}" for n, c in by_kernel.items())
        + ")"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick test grids and benchmark sweep")
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
