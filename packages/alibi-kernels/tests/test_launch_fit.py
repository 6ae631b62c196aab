"""The ahead-of-time fit check (CI, CPU only): every config `launch_configs` returns, compiled for its target.

Grid "ci" of benchmarks/fit_report.py: bf16 and fp32 (fp16 compiles to the same shared memory as bf16: the "full"
grid checks it), head dims 64, 128 and 256, the three kernels, every config returned for sm_80, sm_86, sm_89 and
sm_90, with the launch code's own arguments and specialisations. sm_80 and sm_89 share sm_86's Triton GPU IR, so
one sm_86 compile gives their shared memory; registers and spills come from ptxas for sm_86 and sm_90. It fails
when a config exceeds its target's shared memory, compiles to more than shared_memory.json says (a kernel change
that makes the table stale), or spills more than `spill_budget` (zero at these head dims on sm_86 and sm_90).
It compiles with whatever Triton is installed, and passes under 3.6.0, 3.7.1, 3.8.0 and 3.9.0: register use differs
between them (launch_configs.py says how the candidates were chosen), so run it under a new release before trusting
the table there.

Cost on 2 cores: 106 compiles, 2 worker processes (ALIBI_KERNELS_FIT_WORKERS); each result is cached under
Triton's own compile key (ALIBI_KERNELS_FIT_CACHE), so a rerun of unchanged kernels compiles nothing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_report.py"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_returned_config_fits_its_target_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated to silence its warning
    workers = env.get("ALIBI_KERNELS_FIT_WORKERS", "2")
    cmd = [sys.executable, str(REPORT), "--grid", "ci", "--check", "--workers", workers]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, tail
    assert "fit check: passed" in proc.stdout, tail
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| fwd") or line.startswith("| d")]
    assert {line.split(" | ")[0][2:] for line in rows} == {"fwd", "dkdv", "dq"}, tail
