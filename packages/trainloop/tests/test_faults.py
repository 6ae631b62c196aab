"""Preemption, kills during a save, and a hung rank, each in a real subprocess."""

import json
import signal

import pytest
import torch
from launch import command, run
from tiny_model import SeqData, TinyLM
from watch import Watched

from trainloop import TrainConfig, Trainer, latest_checkpoint, load_model_weights
from trainloop.checkpoint import CheckpointStore


def _start(args, nproc=1):
    return Watched(command("train_tiny.py", args, nproc))


def _summary(out):
    return json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[8:])


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = _start({"run_dir": str(tmp_path), "max_steps": 100000, "t_max": 1000})
    proc.wait_for("step 5 |")
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.finish(timeout=120) == 0, proc.output()[-4000:]
    summary = _summary(proc.output())
    assert summary["stopped"] == "SIGTERM" and 5 < summary["step"] < 100000
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and int(ckpt.name.split("_")[1]) == summary["step"]
    # The preempted run resumes where it stopped.
    cfg = TrainConfig(max_steps=summary["step"] + 2, t_max=1000, progress=False, tensorboard=False, micro_batch=8)
    t = Trainer(TinyLM(), cfg, SeqData(8), run_dir=tmp_path)
    assert t.fit(resume=True)["step"] == summary["step"] + 2


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    proc = _start({"run_dir": str(tmp_path), "max_steps": 100, "save_every": 2, "slow_save_at": 4})
    proc.wait_for("SAVE_IN_PROGRESS")
    proc.kill()
    assert (tmp_path / "checkpoints" / ".tmp-step_00000004" / "model.safetensors").exists()  # killed mid-save
    ckpt, skipped = CheckpointStore(tmp_path).find_resumable()
    assert ckpt.name == "step_00000002"
    assert [p.name for p, _ in skipped] == [".tmp-step_00000004"]
    model = TinyLM()
    model.load_state_dict(load_model_weights(ckpt))
    cfg = TrainConfig(max_steps=3, t_max=10, progress=False, tensorboard=False, micro_batch=8)
    assert Trainer(model, cfg, SeqData(8), run_dir=tmp_path).fit(resume=True)["step"] == 3


@pytest.mark.slow
def test_hung_rank_makes_the_other_fail_clearly(tmp_path):
    args = {"run_dir": str(tmp_path), "max_steps": 10, "hang_rank_at": [1, 3], "dist_timeout_s": 5}
    with pytest.raises(AssertionError) as info:
        run("train_tiny.py", args, nproc=2, timeout=200)
    text = str(info.value)
    assert "rank 1 hangs" in text
    assert "rank 0: a collective operation failed at step 3" in text and "dist_timeout_s=5" in text


def test_detect_anomaly_names_the_operation(tmp_path):
    class SqrtNeg(TinyLM):
        def forward(self, inputs, targets):
            return super().forward(inputs, targets) + (self.head.weight.sum() * 0 - 1).sqrt()

    torch.manual_seed(0)
    cfg = TrainConfig(max_steps=3, detect_anomaly=True, progress=False, tensorboard=False)
    with pytest.raises(RuntimeError, match="SqrtBackward"), pytest.warns(UserWarning):
        Trainer(SqrtNeg(), cfg, SeqData(4), run_dir=tmp_path).fit()


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_zero2_checkpoint_on_both_ranks(tmp_path):
    # What a preempted `lmtrain train` under torchrun sees: torchrun forwards SIGTERM to every rank.
    proc = _start({"run_dir": str(tmp_path), "engine": "deepspeed", "max_steps": 100000, "t_max": 1000}, nproc=2)
    # DeepSpeed's first start JIT-builds its shared-memory op (about 90 s alone on 2 cores, more when they are busy).
    proc.wait_for("step 5 |", timeout=600)
    proc.proc.send_signal(signal.SIGTERM)
    # What a scheduler sees: torchrun, signalled itself, exits 1 (its SignalException), so a restart policy on a
    # non-zero status re-runs the preempted job; a finished run exits 0. The ranks themselves save and exit 0.
    code = proc.finish(timeout=120)
    assert code == 1, (code, proc.output()[-4000:])
    assert "SignalException" in proc.output() and "ChildFailedError" not in proc.output()
    summary = _summary(proc.output())
    assert summary["stopped"] == "SIGTERM"
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == f"step_{summary['step']:08d}"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"rank0.pt", "rank1.pt", "model.safetensors", "train_config.json", "ds_config.json"} <= set(files)
    assert json.loads((ckpt / "ds_config.json").read_text())["gradient_clipping"] == 0.0
    assert sum("optim_states" in f for f in files) == 2  # each rank's ZeRO-2 optimizer shard
