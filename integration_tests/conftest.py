"""Shared fixtures: the test data, a prepared TinyShakespeare slice, and a runner for the installed commands.

The data is read in place from ../shared/data next to the repository root; tests that need it skip with the
reason when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHAKESPEARE = DATA_ROOT / "tinyshakespeare" / "input.txt"
SLICE_CHARS = 200_000  # train on this much of TinyShakespeare; the next 20_000 characters validate


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every command the tests start: CPU DeepSpeed, one thread per process (several
    processes share 2 cores; two OpenMP threads per process measured 5x slower there), quiet progress."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        TQDM_DISABLE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def lmtrain_cmd(*args: str) -> list[str]:
    """`python -m lmtrain ...` with this interpreter (the venv the wheels were installed into)."""
    return [sys.executable, "-m", "lmtrain", *args]


def run_lmtrain(*args: str, timeout: float = 300, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(lmtrain_cmd(*args), capture_output=True, text=True, timeout=timeout, env=child_env(**env))
    if check and result.returncode != 0:
        raise AssertionError(
            f"lmtrain {' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
            f"stderr:\n{result.stderr[-3000:]}"
        )
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl (evaluation records left out)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="session")
def shakespeare_texts(tmp_path_factory) -> tuple[Path, Path]:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"test data absent: {SHAKESPEARE} (expected ../shared/data next to the repository root)")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("texts")
    train, val = root / "train.txt", root / "val.txt"
    train.write_text(text[:SLICE_CHARS], encoding="utf-8")
    val.write_text(text[SLICE_CHARS : SLICE_CHARS + 20_000], encoding="utf-8")
    return train, val


@pytest.fixture(scope="session")
def prepared(shakespeare_texts, tmp_path_factory) -> Path:
    """A data directory prepared by `lmtrain prepare` from the TinyShakespeare slice (vocabulary 512)."""
    train, val = shakespeare_texts
    out = tmp_path_factory.mktemp("data")
    run_lmtrain("prepare", "--text", str(train), "--val-text", str(val), "--out", str(out), "--vocab-size", "512")
    return out
