"""`lmtrain train`, unchanged, under both launchers on 2 CPU ranks: `torchrun` and DeepSpeed's `deepspeed`.

DeepSpeed's launcher counts CPU "accelerators" as NUMA nodes (one here), so it is given `--num_accelerators 2`
(`--num_gpus`' other name) with DS_ACCELERATOR=cpu; without a hostfile it runs locally, with no ssh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, read_metrics
from test_distributed import free_port, torchrun

pytestmark = pytest.mark.slow

DEEPSPEED = Path(sys.executable).with_name("deepspeed")
STEPS = 4


def train_args(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--max-steps", str(STEPS),
            "--set", "log_every=1", "--set", f"save_every={STEPS}", *extra]  # fmt: skip


def check_two_ranks_trained(result: subprocess.CompletedProcess, run: Path) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, STEPS + 1))
    ckpt = run / "checkpoints" / f"step_{STEPS:08d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    # Each rank saves its own RNG and loader position: both ranks reached the checkpoint.
    assert {"rank0.pt", "rank1.pt"} <= set(manifest["files"])


def test_torchrun(prepared, tmp_path):
    run = tmp_path / "run"
    cmd = torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "lmtrain", *train_args(prepared, run))  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    check_two_ranks_trained(result, run)
    assert json.loads((run / "run.json").read_text())["train_config"]["engine"] == "torch"


def deepspeed_launcher(*args: str) -> list[str]:
    return [str(DEEPSPEED), "--num_accelerators", "2", "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), *args]  # fmt: skip


# As the launcher runs it (python -m lmtrain --local_rank=0 train ...), and with --no_local_rank.
@pytest.mark.parametrize("local_rank_flag", ["appended", "--no_local_rank"])
def test_deepspeed_launcher(prepared, tmp_path, local_rank_flag):
    if not DEEPSPEED.is_file():
        pytest.skip(f"no deepspeed launcher next to {sys.executable}")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    run = tmp_path / "run"
    flags = [local_rank_flag] if local_rank_flag.startswith("--") else []
    train = train_args(prepared, run, "--deepspeed", str(ds_config), "--set", "precision=bf16")
    cmd = deepspeed_launcher(*flags, "--module", "lmtrain", *train)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    check_two_ranks_trained(result, run)
    assert json.loads((run / "run.json").read_text())["train_config"]["engine"] == "deepspeed"
