"""`lmtrain finetune --from DIR --deepspeed` (a Hugging Face base: a tiny random Qwen2 written by transformers here)
under torchrun on 2 CPU gloo ranks with ZeRO-2, LoRA and full fine-tuning, against the same fine-tune in one process
on the torch engine: the losses step by step and the weights that trained; the LoRA run resumed in one process
(--verify full, the batch re-split) follows the one-process run extended alike."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "lmtrain" / "tests"))
from hf_base import write_qwen2_base  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

STEPS, GLOBAL_ROWS = 4, 8
FT = ["--seq-len", "64", "--max-steps", str(STEPS), "--set", "cpu_threads=1", "--set", "eval_every=0", "--set",
      "lr=1e-2", "--set", "log_every=1", "--no-progress"]  # fmt: skip
# fp32 on both sides: ZeRO-2's reduction over 2 ranks against one process's sum, float summation order only.
# Measured here: losses within 1e-7 relative; weights after 4 AdamW steps of lr 1e-2 within 4e-6 (Adam divides
# gradients of near-zero entries by their own size, which makes order-of-summation noise a visible step).
RTOL, ATOL = 1e-5, 1e-5


def _finetune(base: Path, data: Path, out: Path, method: str, ranks: int, *flags: str, resume: bool = False) -> str:
    """The fine-tune on ``ranks`` ranks (one process for 1), a global batch of GLOBAL_ROWS rows; ``resume``: the
    run's own settings, which a new micro-batch would override."""
    rows = () if resume else ("--set", f"micro_batch={GLOBAL_ROWS // ranks}")
    lmtrain = ["-m", "lmtrain", "finetune", "--from", str(base), "--data", str(data), "--out", str(out),
               "--method", method, *FT, *rows, *flags]  # fmt: skip
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(port), *lmtrain]  # fmt: skip
    else:
        cmd = [sys.executable, *lmtrain]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _losses(run: Path) -> list[float]:
    """The training loss of each step (a resumed run's later records win)."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_deepspeed_zero2_on_two_ranks_equals_one_process(tmp_path, method):
    base = write_qwen2_base(tmp_path / "qwen")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} times two?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(48)]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    _finetune(base, data, tmp_path / "one", method, 1)
    _finetune(base, data, tmp_path / "two", method, 2, "--deepspeed", str(ds))
    record = json.loads((tmp_path / "two" / "run.json").read_text())
    assert record["world_size"] == 2 and record["train_config"]["engine"] == "deepspeed"
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == STEPS and one[-1] < one[0]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=RTOL, atol=0)
    step = f"step_{STEPS:08d}"
    a = load_file(str(tmp_path / "one" / "checkpoints" / step / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "checkpoints" / step / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # every tensor, the trained ones and the frozen base
        torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=ATOL, msg=name)
    assert (tmp_path / "two" / "loss.png").is_file()
    if method == "lora":
        adapters = load_file(str(tmp_path / "two" / "adapters.safetensors"))
        assert adapters and all(torch.equal(t, b[n]) for n, t in adapters.items())
        # One process resumes the 2-rank run past its end (--verify full), its batch re-split to keep the global
        # batch; the one-process run is extended the same way, so the two schedules stay equal.
        more = ("--resume", "--max-steps", str(STEPS + 2), "--verify", "full", "--deepspeed", str(ds))
        resumed = _finetune(base, data, tmp_path / "two", method, 1, *more, resume=True)
        assert "resuming a run of 2 rank(s) on 1: grad_accum 1 -> 2" in resumed, resumed[-2000:]
        _finetune(base, data, tmp_path / "one", method, 1, "--resume", "--max-steps", str(STEPS + 2), resume=True)
        one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
        assert len(one) == len(two) == STEPS + 2
        torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=RTOL, atol=0)
