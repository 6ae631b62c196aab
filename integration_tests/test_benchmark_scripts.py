"""The headline benchmark script runs end to end on a text of its own: its figures come from the benchmark's text
(../shared/data, absent from CI), but a change to what `lmtrain` prints must not break the script unseen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import child_env

from lmtrain.corpus import build_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_bench_shakespeare_runs_on_another_text(tmp_path):
    text = tmp_path / "corpus.txt"
    build_corpus(text, 300_000)  # enough text for prepare's default 2048 pieces
    command = [sys.executable, str(ROOT / "tools" / "bench_shakespeare.py"), "--text", str(text), "--time-budget",
               "8", "--workdir", str(tmp_path / "work"), "--set", "cpu_threads=1"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = dict(line.split("  ", 1) for line in result.stdout.splitlines() if "  " in line)
    bits = float(rows["bits per char (val, sliding windows)"].strip())
    assert 0 < bits < 16 and "steps, tokens seen" in rows, result.stdout
