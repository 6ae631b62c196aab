"""Run the test scripts as real subprocesses: single process or torchrun with gloo ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def command(script: str, args: dict, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(SCRIPTS / script), json.dumps(args)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            str(SCRIPTS / script), json.dumps(args)]  # fmt: skip


def run(script: str, args: dict, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(script, args, nproc), env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def tagged(proc: subprocess.CompletedProcess, tag: str) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    raise AssertionError(f"no {tag} line in output:\n{proc.stdout[-3000:]}")
