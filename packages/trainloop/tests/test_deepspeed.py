"""DeepSpeed on CPU for real: 2 gloo ranks under torchrun, compared with a single-process torch run."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import run, tagged
from test_ds_config import REFERENCE_DS_CONFIG
from tiny_model import SeqData, TinyLM

from trainloop import TrainConfig, Trainer, latest_checkpoint, load_model_weights
from trainloop.checkpoint import sha256_file

CLIP = {"embed.*": 0.3, "*o_proj*": 0.05}


def _records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _reference(run_dir, steps):
    """Single process, plain torch, fp32, the same global batch of 8 rows."""
    torch.manual_seed(0)
    cfg = TrainConfig(lr=1e-2, min_lr=1e-4, warmup_steps=2, max_steps=steps, micro_batch=8, log_every=1,
                      progress=False, tensorboard=False, clip_groups=CLIP)  # fmt: skip
    Trainer(TinyLM(), cfg, SeqData(8), run_dir=run_dir).fit()
    return _records(run_dir), load_model_weights(latest_checkpoint(run_dir))


def _close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


@pytest.mark.slow
def test_zero2_two_ranks_match_single_process_and_resume(tmp_path):
    ref, ref_w = _reference(tmp_path / "ref", 10)
    ds_dir = tmp_path / "ds"
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}
    args = {"run_dir": str(ds_dir), "engine": "deepspeed", "max_steps": 10, "save_every": 5, "clip_groups": CLIP,
            "ds_config": {"zero_optimization": zero}}  # fmt: skip
    run("train_tiny.py", args, nproc=2)
    got = _records(ds_dir)
    assert [r["step"] for r in got] == list(range(1, 11))
    # Stated tolerance: 1e-5 relative (fp32; only the reduction order differs between 1 and 2 ranks).
    for r, g in zip(ref, got, strict=True):
        for key in ("loss", "grad_norm", "grad_norm/embed.*", "grad_norm/*o_proj*", "grad_norm/default"):
            assert _close(r[key], g[key], 1e-5), (r["step"], key, r[key], g[key])
        assert r["clip_factor/*o_proj*"] < 1.0 and _close(r["clip_factor/*o_proj*"], g["clip_factor/*o_proj*"], 1e-5)
    ds_w = load_model_weights(latest_checkpoint(ds_dir))  # consolidated fp32, loaded here by one process
    for k in ref_w:
        torch.testing.assert_close(ds_w[k], ref_w[k], rtol=1e-5, atol=1e-6)
    # Exact resume with 2 ranks: drop the final checkpoint, resume from step 5, compare steps 6-10.
    resumed = tmp_path / "resumed"
    shutil.copytree(ds_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000010")
    run("train_tiny.py", {**args, "run_dir": str(resumed), "resume": True}, nproc=2)
    again = _records(resumed)
    assert [r["step"] for r in again] == list(range(1, 11))
    for a, b in zip(got[5:], again[5:], strict=True):
        # Bit for bit here (deterministic 2-rank gloo reductions); the bound is 1e-6 relative.
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
def test_zero_stages_0_1_3_bf16_and_offload_config_two_ranks(tmp_path):
    ref, _ = _reference(tmp_path / "ref", 4)
    cases = [{"stage": s, "precision": "fp32"} for s in (0, 1, 3)]
    cases.append({"stage": 2, "precision": "bf16", "inspect_steps": [2]})
    # The reference 1.3B recipe's config as is: 128 = micro_batch 16 x grad_accum 4 x 2 ranks; optimizer offloaded to
    # pinned CPU memory, overlap_comm, contiguous_gradients, an AdamW block (the loop builds the optimizer).
    offload = {"stage": 2, "precision": "bf16", "ds_config": REFERENCE_DS_CONFIG, "grad_accum": 4,
               "global_batch": 128, "tied": True}  # fmt: skip
    on_device = json.loads(json.dumps(REFERENCE_DS_CONFIG))
    del on_device["zero_optimization"]["offload_optimizer"]
    cases.append({"name": "offload", **offload})
    cases.append({"name": "offload_off", **offload, "ds_config": on_device})  # the same run, the optimizer not moved
    # A broken twin: an offloaded step that changes nothing (learning rate 1e-12); the comparison below catches it.
    cases.append({"name": "offload_no_step", **offload, "lr": 1e-12, "min_lr": 1e-12})
    out = tagged(run("ds_stages.py", {"run_dir": str(tmp_path), "steps": 4, "cases": cases}, nproc=2), "RESULTS")
    ref_loss = [r["loss"] for r in ref]
    ref_norm = [r["grad_norm"] for r in ref]
    for name in ("0_fp32", "1_fp32", "3_fp32"):
        assert all(_close(a, b, 1e-5) for a, b in zip(ref_loss, out[name]["loss"], strict=True)), (name, out[name])
        assert all(_close(a, b, 1e-5) for a, b in zip(ref_norm, out[name]["norms"], strict=True)), (name, out[name])
    # bf16 weights and activations: stated tolerance 1e-2 relative over 4 steps.
    assert all(_close(a, b, 1e-2) for a, b in zip(ref_loss, out["2_bf16"]["loss"], strict=True)), out["2_bf16"]

    # The gradient inspector gathers full gradients from the ZeRO-2 partitions: they add up to the logged norm.
    rows = (Path(out["2_bf16"]["run_dir"]) / "inspect" / "grads_step2.tsv").read_text().splitlines()[1:]
    total = sum(float(r.split("\t")[3]) ** 2 for r in rows) ** 0.5
    assert len(rows) == 6 and _close(total, out["2_bf16"]["norms"][1], 1e-4), (total, out["2_bf16"]["norms"])

    offload = out["offload"]
    assert len(offload["loss"]) == 4 and offload["loss"][-1] < offload["loss"][0]
    # Offloading moves where AdamW runs, not what it computes: the losses of the same run without offload, within
    # the bf16 tolerance above (on CPU both optimizers step on the host).
    assert all(_close(a, b, 1e-2) for a, b in zip(offload["loss"], out["offload_off"]["loss"], strict=True)), out
    frozen = out["offload_no_step"]["loss"]
    assert not all(_close(a, b, 1e-2) for a, b in zip(frozen[1:], out["offload_off"]["loss"][1:], strict=True))
    assert any(
        "the loop builds torch AdamW (fused, on the host for offload_optimizer cpu)" in n for n in offload["notes"]
    )
    ckpt = latest_checkpoint(offload["run_dir"])
    assert (ckpt / "deepspeed" / "state").is_dir()
    weights = load_model_weights(ckpt)
    assert weights["head.weight"].dtype == torch.float32 and torch.equal(
        weights["head.weight"], weights["embed.weight"]
    )
    assert weights["position_ids"].dtype == torch.int64 and "scratch" not in weights
    TinyLM(tied=True).load_state_dict(weights)  # strict: every key present, none extra


@pytest.mark.slow
def test_zero2_nan_on_one_rank_skips_on_both_with_optimizer_untouched(tmp_path):
    args = {"run_dir": str(tmp_path), "engine": "deepspeed", "max_steps": 4, "save_every": 1, "keep_last": 10,
            "nan_at": [1, 3], "ds_config": {"zero_optimization": {"stage": 2}}}  # fmt: skip
    summary = tagged(run("train_tiny.py", args, nproc=2), "SUMMARY")
    assert summary["total_skips"] == 1 and summary["step"] == 4
    recs = _records(tmp_path)
    assert recs[2]["loss"] is None and recs[2]["skipped"] == 1  # NaN is written as null
    assert all(r["loss"] is not None and r["skipped"] == 0 for r in recs[:2] + recs[3:])
    w = {s: load_model_weights(tmp_path / "checkpoints" / f"step_{s:08d}") for s in (2, 3, 4)}
    assert all(torch.equal(w[2][k], w[3][k]) for k in w[2])  # the skipped step changed nothing
    assert not all(torch.equal(w[3][k], w[4][k]) for k in w[3])  # the next one trains again
    opt = {s: torch.load(tmp_path / "checkpoints" / f"step_{s:08d}" / "deepspeed" / "state" /
                         "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False) for s in (2, 3)}  # fmt: skip
    base2 = opt[2]["optimizer_state_dict"]["base_optimizer_state"]["state"]
    base3 = opt[3]["optimizer_state_dict"]["base_optimizer_state"]["state"]
    assert _same_state(base2, base3)  # AdamW moments and step counts untouched (only the scheduled lr moved)


def _same_state(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class _Payload:
    """What a hostile checkpoint would hold: an object whose unpickling runs a command (here: creates a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("which", ["optim_states", "model_states"])
def test_deepspeed_checkpoint_files_are_read_without_running_code(tmp_path, which):
    args = {"engine": "deepspeed", "ds_config": {"zero_optimization": {"stage": 2}}, "max_steps": 2, "save_every": 2,
            "run_dir": str(tmp_path / "run")}  # fmt: skip
    run("train_tiny.py", args)
    (target,) = (tmp_path / "run" / "checkpoints" / "step_00000002" / "deepspeed" / "state").glob(f"*{which}.pt")
    state = torch.load(target, weights_only=False)
    marker = tmp_path / "ran"
    state["payload"] = _Payload(marker)
    torch.save(state, target)
    # The manifest made to match, as whoever wrote the file would: the checkpoint passes every size and hash check.
    manifest_path = target.parents[2] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = str(target.relative_to(target.parents[2]))
    manifest["files"][entry] = {"sha256": sha256_file(target), "bytes": target.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(AssertionError) as failed:
        run("train_tiny.py", {**args, "max_steps": 4, "resume": True})
    assert f"{target.name}: refused: it holds " in str(failed.value), str(failed.value)[-2000:]
    assert not marker.exists()


@pytest.mark.parametrize("fp16", [False, True], ids=["no-fp16", "fp16"])
def test_zero3_init_keeps_the_models_dtype_where_the_accelerator_has_no_fp16(monkeypatch, fp16):
    """DeepSpeed's zero.Init turns a given fp32 into bf16 on an accelerator without fp16 (an AVX2-only CPU), which
    failed the NVMe offload test there; within compat.keeping_model_dtype the given dtype stays."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    from trainloop import deepspeed_compat as compat

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: fp16)
    init = object.__new__(Init)
    Init._set_dtype(init, None, torch.float32)
    assert init.dtype == (torch.float32 if fp16 else torch.bfloat16)  # DeepSpeed's own answer (0.19.8)
    with compat.keeping_model_dtype():
        Init._set_dtype(init, None, torch.float32)
        assert init.dtype == torch.float32
        Init._set_dtype(init, None, None)
        assert init.dtype == (torch.float16 if fp16 else torch.bfloat16)  # no dtype given: DeepSpeed's choice
    Init._set_dtype(init, None, torch.float32)
    assert init.dtype == (torch.float32 if fp16 else torch.bfloat16)  # restored after the block
