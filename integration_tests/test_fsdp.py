"""`lmtrain train --engine fsdp` under torchrun on 2 CPU gloo ranks, resumed on one process and refused by another
engine; LoRA under trainloop's FSDP engine: the frozen base is sharded, only the adapters train."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from conftest import child_env, read_metrics, run_lmtrain

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


def test_lmtrain_train_engine_fsdp_under_torchrun(prepared, texts, tmp_path):
    run = tmp_path / "run"
    flags = ["--preset", "tiny", "--set", "log_every=2", "--set", "micro_batch=4", "--set", "save_every=3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "lmtrain", "train", "--data", str(prepared), "--out", str(run),
           "--engine", "fsdp", "--max-steps", "6", *flags]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fsdp engine, 2 rank(s)" in result.stdout
    run_info = json.loads((run / "run.json").read_text())
    assert run_info["train_config"]["engine"] == "fsdp" and run_info["world_size"] == 2
    files = json.loads((run / "checkpoints" / "step_00000006" / "manifest.json").read_text())["files"]
    assert "dcp/__0_0.distcp" in files and "dcp/__1_0.distcp" in files and "model.safetensors" in files
    _, val = texts
    ev = run_lmtrain("eval", "--run", str(run), "--text", str(val), "--json", "--context", "32")
    assert json.loads(ev.stdout.strip().splitlines()[-1])["tokens"] > 0
    # One process resumes the sharded checkpoint with the run's own engine (run.json), re-split over one rank.
    resumed = run_lmtrain("train", "--data", str(prepared), "--out", str(run), "--max-steps", "8", "--resume", *flags)
    assert "step_00000006 was written by 2 rank(s); resuming on 1" in resumed.stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [2, 4, 6, 8]
    # Another engine cannot read it: one line naming the engine to resume with, nothing written.
    refused = run_lmtrain("train", "--data", str(prepared), "--out", str(run), "--max-steps", "10", "--resume",
                          "--engine", "torch", *flags, check=False)  # fmt: skip
    assert refused.returncode == 2
    error = [x for x in refused.stderr.splitlines() if x.startswith("lmtrain train: error:")]
    assert error and "written by engine 'fsdp'" in error[0] and "--engine fsdp" in error[0], refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_00000008"


def test_lmtrain_fsdp_expecting_ranks_without_a_launcher_is_one_line(prepared, tmp_path):
    run = tmp_path / "run"
    result = run_lmtrain("train", "--data", str(prepared), "--out", str(run), "--preset", "tiny", "--engine", "fsdp",
                         "--max-steps", "2", check=False, WORLD_SIZE="2")  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("lmtrain train: error:")]
    assert "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set" in line and "torchrun --nproc_per_node 2" in line
    assert not list(run.glob("checkpoints/step_*"))
