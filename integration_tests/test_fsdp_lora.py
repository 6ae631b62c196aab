"""LoRA under trainloop's FSDP engine on 2 CPU gloo ranks: the frozen base is sharded, only the adapters train."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from conftest import child_env

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_lora_fsdp.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lora_under_fsdp_trains_only_the_adapters(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("LORA "))
    report = json.loads(line[len("LORA ") :])
    assert report["trainable"] and all(".lora_" in n for n in report["trainable"])
    assert report["changed"] == report["trainable"]  # every adapter moved, no base weight did
    assert report["stepped"] == len(report["trainable"]) and report["frozen_sharded"]
    assert report["reloaded_adapters"] == len(report["trainable"])  # from_pretrained applies the adapters again
