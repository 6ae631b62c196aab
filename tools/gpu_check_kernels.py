"""GPU check for alibi-kernels: the gpu-marked tests, then the full benchmark table.

Run on a CUDA host from the repository root, with alibi-kernels installed (editable or not):

    python tools/gpu_check_kernels.py            # tests (one config per head dim) + full benchmark
    python tools/gpu_check_kernels.py --quick    # smaller test grid and benchmark sweep
    python tools/gpu_check_kernels.py --skip-tests

Exits 2 with a message when CUDA is absent, 1 when the tests or the benchmark fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packages" / "alibi-kernels"


def _run(title: str, cmd: list[str], env: dict[str, str], timeout_s: int) -> int:
    print(f"\n=== {title}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"=== {title}: timed out after {timeout_s} s", flush=True)
        return 124
    print(f"=== {title}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller GPU test grid (T in 1, 100, 4096) and benchmark sweep"
    )
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    parser.add_argument("--skip-bench", action="store_true", help="only the tests")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per step")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_check_kernels: CUDA is not available to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda}); run this on a host with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    failures = 0
    if not args.skip_tests:
        # One config per head dim keeps the ~570-case grid to one compilation per shape class;
        # test_gpu_autotuned_configs_bf16 switches autotuning back on for itself.
        test_env = {**env, "ALIBI_KERNELS_AUTOTUNE": "0", "ALIBI_KERNELS_GPU_GRID": "quick" if args.quick else "full"}
        cmd = [sys.executable, "-m", "pytest", str(PACKAGE / "tests"), "-m", "gpu", "-q", "-x", "--durations=10"]
        failures += _run("gpu tests", cmd, test_env, args.timeout) != 0
    if not args.skip_bench:
        cmd = [sys.executable, str(PACKAGE / "benchmarks" / "bench_attention.py")] + (["--quick"] if args.quick else [])
        failures += _run("benchmark", cmd, env, args.timeout) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
