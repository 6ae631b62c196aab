"""ZeRO-3, alone and with its parameters and optimizer states offloaded (CPU, NVMe), on 2 gloo ranks: the same
losses as ZeRO-2 and as one process, the consolidated export, exact resume (resume on another number of ranks is in
test_world_size_resume.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import run, tagged
from test_deepspeed import CLIP, _close, _reference

from trainloop import latest_checkpoint, load_model_weights
from trainloop.offload import build_aio

STEPS = 30


@pytest.mark.slow
def test_zero3_and_its_parameter_offload_match_zero2_and_one_process_over_30_steps(tmp_path):
    ref, ref_w = _reference(tmp_path / "ref", STEPS)
    zero3 = {"stage": 3}
    param_cpu = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    both_cpu = {**param_cpu, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    cases = [{"name": name, "stage": zero["stage"], "precision": "fp32", "clip_groups": CLIP,
              "ds_config": {"zero_optimization": zero}}
             for name, zero in (("zero2", {"stage": 2}), ("zero3", zero3), ("param_cpu", param_cpu),
                                ("param_optimizer_cpu", both_cpu))]  # fmt: skip
    out = tagged(run("ds_stages.py", {"run_dir": str(tmp_path), "steps": STEPS, "cases": cases}, nproc=2), "RESULTS")
    assert out["param_cpu"]["zero3"] == {"offload_param": True, "offload_optimizer": False, "swap_optimizer": False}
    assert out["param_optimizer_cpu"]["zero3"] == {"offload_param": True, "offload_optimizer": True,
                                                   "swap_optimizer": False}  # fmt: skip
    assert out["zero3"]["zero3"]["offload_param"] is False
    assert "ZeRO-3 keeps the parameter partitions on cpu" in out["param_cpu"]["notes"][0]
    ref_loss = [r["loss"] for r in ref]
    ref_norm = [r["grad_norm"] for r in ref]

    def far(a, b):  # the steps where two series differ by more than the stated tolerance
        return [(s, x, y) for s, (x, y) in enumerate(zip(a, b, strict=True), 1) if not _close(x, y, 1e-5)]

    worst = {}
    for name in ("zero2", "zero3", "param_cpu", "param_optimizer_cpu"):
        got = out[name]
        assert len(got["loss"]) == STEPS
        # Stated tolerance: 1e-5 relative (fp32; only the reduction order differs), against one process and ZeRO-2.
        for loss, norm in ((ref_loss, ref_norm), (out["zero2"]["loss"], out["zero2"]["norms"])):
            assert far(loss, got["loss"]) == [] and far(norm, got["norms"]) == [], name
        worst[name] = max(abs(a - b) / abs(a) for a, b in zip(ref_loss, got["loss"], strict=True))
        # The consolidated fp32 export, loaded by one process, is the single process's model.
        weights = load_model_weights(latest_checkpoint(got["run_dir"]))
        assert weights.keys() == ref_w.keys()
        for key in ref_w:
            torch.testing.assert_close(weights[key], ref_w[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    assert ref_loss[-1] < ref_loss[0] - 0.5, ref_loss  # it learns: the comparison is not between constants
    print("worst relative loss difference to one process:", json.dumps(worst))


def _records(run_dir):
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.slow
def test_nvme_offload_of_parameters_and_optimizer_trains_resumes_and_refuses_another_world_size(tmp_path):
    reason = build_aio()  # JIT-built once here (minutes), not by both ranks at once
    if reason is not None:
        pytest.skip(f"DeepSpeed's async I/O op cannot build here: {reason} (apt-get install libaio-dev)")
    swap = tmp_path / "nvme"
    swap.mkdir()
    # Width 1024: o_proj's 1M elements give each rank a 2 MiB partition, above DeepSpeed's 1 MiB minimum for a
    # swapped tensor; the buffers are kept small (the defaults pin 2 GiB per rank); max_in_cpu 0 keeps the parameter
    # partitions on NVMe (by default DeepSpeed moves up to 1e9 elements of them back to host memory for good).
    zero = {"stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "buffer_count": 4, "buffer_size": 2**20,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "buffer_count": 4}}  # fmt: skip
    config_file = tmp_path / "ds_config.json"  # as `--deepspeed FILE` passes it
    config_file.write_text(json.dumps({"zero_optimization": zero}))
    common = {"engine": "deepspeed", "max_steps": 6, "save_every": 3, "keep_last": 5, "width": 1024, "lr": 1e-3,
              "min_lr": 1e-5}  # fmt: skip
    plain = tmp_path / "plain"
    slow = {"timeout": 600}  # swapping through the files: a launch took minutes on the loaded 2-core machine
    run("train_tiny.py", {**common, "run_dir": str(plain), "ds_config": {"zero_optimization": {"stage": 3}}}, nproc=2)
    nvme = tmp_path / "nvme_run"
    args = {**common, "run_dir": str(nvme), "ds_config": str(config_file)}
    run("train_tiny.py", args, nproc=2, **slow)
    swapped = sorted(p.relative_to(swap).parts[1] for p in swap.rglob("*.tensor.swp"))
    assert "float32params" in swapped and "optimizer" in swapped, swapped  # both really went through the files
    first, without = _records(nvme), _records(plain)
    assert sorted(first) == list(range(1, 7)) and first[6] < first[1] - 1.0, first
    # The clipped gradients reach the swapped optimizer (measured: equal to the last bit here; bound 1e-5).
    assert all(_close(first[s], without[s], 1e-5) for s in first), (first, without)
    ckpt = nvme / "checkpoints" / "step_00000006"
    assert (ckpt / "deepspeed" / "state" / "offloaded_tensors").is_dir()
    plain_w, nvme_w = (load_model_weights(p / "checkpoints" / "step_00000006") for p in (plain, nvme))
    for key in plain_w:
        torch.testing.assert_close(nvme_w[key], plain_w[key], rtol=1e-5, atol=1e-7, msg=key)

    resumed = tmp_path / "resumed"
    shutil.copytree(nvme, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    run("train_tiny.py", {**args, "run_dir": str(resumed), "resume": True}, nproc=2, **slow)
    again = _records(resumed)
    # Steps 4-6 as in the uninterrupted run: weights, moments and step counts of swapped and resident sub-groups.
    assert all(_close(again[s], first[s], 1e-6) for s in (4, 5, 6)), (first, again)

    other = tmp_path / "other"
    shutil.copytree(resumed, other)
    shutil.rmtree(other / "checkpoints" / "step_00000006")
    with pytest.raises(AssertionError) as failed:
        run("train_tiny.py", {**args, "run_dir": str(other), "resume": True}, nproc=1, **slow)
    assert "written by 2 rank(s) with offload_optimizer on NVMe, resumed on 1" in str(failed.value)
    assert "resume on 2 rank(s)" in str(failed.value)
