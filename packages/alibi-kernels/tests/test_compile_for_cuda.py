"""Opt-in: compile every kernel for sm_90 on a CPU-only machine (slow: ~30 s per kernel on 2 shared cores)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(
    os.environ.get("ALIBI_KERNELS_COMPILE_CHECK") != "1",
    reason="opt-in (about 5 minutes on 2 shared cores): set ALIBI_KERNELS_COMPILE_CHECK=1",
)
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_cuda.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok   ") == 12, proc.stdout
