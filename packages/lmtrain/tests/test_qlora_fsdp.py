"""`lmtrain finetune --method qlora --engine fsdp` under torchrun on 2 CPU gloo ranks, from a Hugging Face base (a
tiny random Qwen2 written by transformers here), against the same fine-tune in one process: the losses, the
adapters and the dequantized base weights of the checkpoint; `adapters.safetensors` (gathered from the shards)
equal to the final checkpoint's; both kinds of FSDP checkpoint resumed bit-exact."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from hf_base import write_qwen2_base

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("torchao")

from safetensors.torch import load_file  # noqa: E402

from lmtrain.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, SAVE = 4, 2
FT = ["--method", "qlora", "--seq-len", "64", "--max-steps", str(STEPS), "--set", "cpu_threads=1", "--set",
      "eval_every=0", "--set", f"save_every={SAVE}", "--set", "lr=1e-2", "--set", "log_every=1",
      "--no-progress"]  # fmt: skip
GLOBAL_ROWS = 8
# Measured on this machine: the 2-rank losses differ from one process's by at most 8e-8 relative, the adapters by
# 2e-7 (float summation order of another number of ranks); the bounds leave room for other machines.
RTOL = 1e-5
ATOL = 1e-5


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora_fsdp")
    base = write_qwen2_base(root / "qwen")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} times two?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(48)]  # fmt: skip
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = root / "one"
    assert main(["finetune", "--from", str(base), "--data", str(data), "--out", str(one), *FT,
                 "--set", f"micro_batch={GLOBAL_ROWS}"]) == 0  # fmt: skip
    two = root / "two"
    _two_ranks(base, data, two)
    return {"base": base, "data": data, "one": one, "two": two}


def _two_ranks(base, data, out, *flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # "--" ends torchrun's own options: its parser takes abbreviations of them.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "--", "lmtrain", "finetune", "--from", str(base), "--data", str(data),
           "--out", str(out), *FT, "--set", f"micro_batch={GLOBAL_ROWS // 2}", "--engine", "fsdp", *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0", "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _losses(run):
    """step -> training loss (a resumed run's later records win)."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _weights(run, step=STEPS):
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def _resume_copy(src, dst):
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step_{STEPS:08d}")  # as if the run had stopped after step SAVE
    (dst / "adapters.safetensors").unlink()
    return dst


def test_qlora_under_fsdp_on_two_ranks_equals_one_process(made):
    one, two = made["one"], made["two"]
    record = json.loads((two / "run.json").read_text())
    assert record["world_size"] == 2 and record["train_config"]["engine"] == "fsdp"
    assert record["finetune"]["method"] == "qlora"
    got, want = _losses(two), _losses(one)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    print(f"worst relative loss difference {worst:.2e}")
    assert worst <= RTOL, worst
    files = json.loads((two / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").read_text())["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "model.safetensors"} <= set(files)
    # The checkpoint reads back as LoRA: every tensor one process writes, the base dequantized from the same NF4
    # codes (the format does not depend on the number of ranks), the adapters trained alike.
    ours, theirs = _weights(two), _weights(one)
    assert sorted(ours) == sorted(theirs) and any(".base.weight" in k for k in ours)
    for name, tensor in theirs.items():
        if ".lora_" in name:
            torch.testing.assert_close(ours[name], tensor, rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(ours[name], tensor), name
    adapters = load_file(str(two / "adapters.safetensors"))
    assert sorted(adapters) == sorted(k for k in ours if ".lora_" in k)
    assert all(torch.equal(adapters[k], ours[k]) for k in adapters)  # gathered from the shards by rank 0
    assert any(float(t.abs().sum()) > 0 for k, t in adapters.items() if k.endswith("lora_B"))  # B moved from zero


def test_sharded_checkpoint_resumes_bit_exact(made, tmp_path):
    resumed = _resume_copy(made["two"], tmp_path / "resumed")
    out = _two_ranks(made["base"], made["data"], resumed, "--resume")
    assert f"resumed from {resumed}/checkpoints/step_{SAVE:08d}" in out.stdout
    assert _losses(resumed) == _losses(made["two"])
    final = _weights(made["two"])
    assert all(torch.equal(t, final[k]) for k, t in _weights(resumed).items())
    assert all(torch.equal(t, final[k]) for k, t in load_file(str(resumed / "adapters.safetensors")).items())


def test_full_state_checkpoint_saves_and_resumes_bit_exact(made, tmp_path):
    full = tmp_path / "full"
    _two_ranks(made["base"], made["data"], full, "--set", "fsdp_checkpoint=full")
    files = json.loads((full / "checkpoints" / f"step_{SAVE:08d}" / "manifest.json").read_text())["files"]
    assert "optimizer.pt" in files and not any(f.startswith("dcp/") for f in files)
    got, want = _losses(full), _losses(made["one"])
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in want) <= RTOL
    resumed = _resume_copy(full, tmp_path / "resumed")
    _two_ranks(made["base"], made["data"], resumed, "--set", "fsdp_checkpoint=full", "--resume")
    assert _losses(resumed) == _losses(full)
    final = _weights(full)
    assert all(torch.equal(t, final[k]) for k, t in _weights(resumed).items())
