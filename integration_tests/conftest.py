"""Shared fixtures: train and validation text cut from this Python's own standard-library source, a data
directory prepared from it, and a runner for the installed commands.

The text is built with `lmtrain demo`'s corpus builder (the library's .py files outside its test suites, sorted, at
a fixed stride), so the tests need nothing outside the repository and no download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmtrain.corpus import build_corpus

TRAIN_CHARS = 200_000  # train on this many characters of the corpus; the next VAL_CHARS validate
VAL_CHARS = 20_000


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
def texts(tmp_path_factory) -> tuple[Path, Path]:
    """(train.txt, val.txt): TRAIN_CHARS and the following VAL_CHARS characters of standard-library source."""
    root = tmp_path_factory.mktemp("texts")
    corpus = root / "corpus.txt"
    # build_corpus stops near its target, not past it: ask for twice what is cut.
    build_corpus(corpus, 2 * (TRAIN_CHARS + VAL_CHARS))
    text = corpus.read_text(encoding="utf-8")
    assert len(text) >= TRAIN_CHARS + VAL_CHARS, f"{corpus}: {len(text):,} characters of standard-library source"
    train, val = root / "train.txt", root / "val.txt"
    train.write_text(text[:TRAIN_CHARS], encoding="utf-8")
    val.write_text(text[TRAIN_CHARS : TRAIN_CHARS + VAL_CHARS], encoding="utf-8")
    return train, val


@pytest.fixture(scope="session")
def prepared(texts, tmp_path_factory) -> Path:
    """A data directory prepared by `lmtrain prepare` from the standard-library text (vocabulary 512)."""
    train, val = texts
    out = tmp_path_factory.mktemp("data")
    run_lmtrain("prepare", "--text", str(train), "--val-text", str(val), "--out", str(out), "--vocab-size", "512")
    return out
