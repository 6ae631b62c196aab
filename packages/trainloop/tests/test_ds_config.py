"""A DeepSpeed JSON config adopted into TrainConfig: batch derivation, "auto", conflicts, schedules, one-line errors."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import run, tagged

from trainloop import ConfigError, TrainConfig, adopt_ds_config, build_ds_config, lr_at

# The reference 1.3B recipe's ZeRO-2 config (4 nodes x 4 RTX 3090), as users bring it.
REFERENCE_DS_CONFIG = {
    "train_batch_size": 128,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
    },
}
CLUSTER_DS_CONFIG = Path(__file__).resolve().parents[3] / "tools" / "cluster-3090" / "ds_config.json"
# What a preset such as lmtrain's 1.3b brings before the JSON is read (its micro batch is not the JSON's).
RECIPE = dict(lr=1e-3, min_lr=1e-6, warmup_steps=500, t_max=10_000, max_steps=10_000, micro_batch=8, grad_accum=2,
              precision="bf16", engine="deepspeed")  # fmt: skip


def test_reference_config_is_adopted_on_16_gpus_and_2_cpu_ranks():
    a = adopt_ds_config(REFERENCE_DS_CONFIG, TrainConfig(**RECIPE), 16, on_cpu=False)
    assert (a.config.micro_batch, a.config.grad_accum, a.config.lr) == (2, 4, 3e-4)
    assert a.config.precision == "bf16" and a.config.clip == 1.0  # not set by the JSON: the run's
    assert "\n" not in a.line
    assert "micro_batch=2 (train_batch_size 128 / (4 x 16 ranks))" in a.line
    assert "grad_accum=4 (gradient_accumulation_steps), lr=0.0003 (optimizer.params.lr)" in a.line
    assert "its AdamW block: the loop builds torch AdamW (fused, on the host for offload_optimizer cpu)" in a.line
    assert "no scheduler block: the loop sets the lr each step (schedule cosine" in a.line
    ds = a.ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        128, 2, 4)  # fmt: skip
    assert "optimizer" not in ds and ds["gradient_clipping"] == 0.0 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_force_ds_cpu_optimizer"] is False  # the loop's fused AdamW steps the offloaded partitions

    cpu = adopt_ds_config(REFERENCE_DS_CONFIG, TrainConfig(**RECIPE), 2, on_cpu=True)
    assert (cpu.config.micro_batch, cpu.config.grad_accum) == (16, 4)
    assert cpu.ds_config["train_micro_batch_size_per_gpu"] == 16 and "(4 x 2 ranks)" in cpu.line


@pytest.mark.skipif(not CLUSTER_DS_CONFIG.is_file(), reason="tools/cluster-3090 is not beside this package")
def test_cluster_kit_config_runs_as_is_on_16_gpus_and_adapted_on_2_cpu_ranks(tmp_path):
    a = adopt_ds_config(CLUSTER_DS_CONFIG, TrainConfig(**RECIPE), 16, on_cpu=False)
    cfg = a.config
    assert (cfg.micro_batch, cfg.grad_accum, cfg.precision, cfg.lr, cfg.beta2, cfg.weight_decay) == (
        2, 4, "bf16", 3e-4, 0.95, 0.1)  # fmt: skip
    assert cfg.clip == 1.0 and a.line.startswith("ds_config.json took ")
    assert a.ds_config["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    # All three batch keys are for 16 ranks: on 2 it is one line with the numbers and the ways out.
    one_line = (r"train_batch_size=128 but train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=4 x "
                r"2 rank\(s\) = 16: on 2 rank\(s\) use micro batch 16")  # fmt: skip
    with pytest.raises(ConfigError, match=one_line):
        adopt_ds_config(CLUSTER_DS_CONFIG, TrainConfig(**RECIPE), 2, on_cpu=True)
    # Adapted for the 2 CPU ranks of a test: the micro batch is left to be derived (16), and fp16 in place of the
    # kit's bf16 shows the CPU adaptation (DeepSpeed has no fp16 on CPU), said in the line.
    kit = json.loads(CLUSTER_DS_CONFIG.read_text())
    del kit["train_micro_batch_size_per_gpu"]
    kit["fp16"], kit["bf16"] = {"enabled": True, "initial_scale_power": 12}, {"enabled": False}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(kit))
    cpu = adopt_ds_config(path, TrainConfig(**RECIPE), 2, on_cpu=True)
    assert (cpu.config.micro_batch, cpu.config.grad_accum, cpu.config.precision) == (16, 4, "bf16")
    assert "on CPU fp16 became bf16" in cpu.line
    assert cpu.ds_config["fp16"]["enabled"] is False and cpu.ds_config["bf16"] == {"enabled": True}
    gpu = adopt_ds_config(path, TrainConfig(**RECIPE), 16, on_cpu=False)
    assert gpu.config.precision == "fp16" and gpu.config.scaler_init_scale == 4096.0
    assert gpu.ds_config["fp16"]["initial_scale_power"] == 12 and gpu.ds_config["bf16"]["enabled"] is False


def test_auto_values_are_filled_from_the_run():
    hf = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }  # fmt: skip
    run = TrainConfig(**RECIPE)
    a = adopt_ds_config(hf, run, 4, on_cpu=False)
    same = ("micro_batch", "grad_accum", "precision", "clip", "lr", "beta1", "beta2", "eps", "weight_decay",
            "warmup_steps", "t_max", "min_lr")  # fmt: skip
    assert all(getattr(a.config, f) == getattr(run, f) for f in same)
    assert a.config.schedule == "wsd" and a.config.wsd_decay_steps == 10_000 - 500  # WarmupDecayLR's linear decay
    ds = a.ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        64, 8, 2)  # fmt: skip
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert "auto" not in json.dumps(ds)
    assert "'auto' filled from the run: train_batch_size, train_micro_batch_size_per_gpu" in a.line
    assert "'auto' left to DeepSpeed's defaults: zero_optimization.reduce_bucket_size" in a.line


def test_conflicts_with_explicit_values_are_one_error_listing_each():
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}  # fmt: skip
    run = TrainConfig(micro_batch=8, grad_accum=4, lr=3e-4, weight_decay=0.0, precision="fp32")
    with pytest.raises(ConfigError) as err:
        adopt_ds_config(ds, run, 2, on_cpu=True, explicit={"micro_batch", "grad_accum", "lr", "precision",
                                                           "weight_decay"}, explicit_prefix="--set ")  # fmt: skip
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("DeepSpeed config: set there and by --set to different values: ")
    for pair in ("micro_batch: 2 from train_micro_batch_size_per_gpu vs 8 from --set micro_batch",
                 "precision: bf16 from bf16.enabled vs fp32 from --set precision",
                 "lr: 0.001 from optimizer.params.lr vs 0.0003 from --set lr"):  # fmt: skip
        assert pair in msg
    assert "grad_accum" not in msg and "weight_decay" not in msg  # equal on both sides
    # Values set only in the JSON win over the run's; those set only explicitly stay.
    a = adopt_ds_config(ds, run, 2, on_cpu=True, explicit={"seed", "clip"})
    assert (a.config.micro_batch, a.config.precision, a.config.lr, a.config.clip) == (2, "bf16", 1e-3, 1.0)


def test_batch_that_does_not_split_over_the_ranks_is_one_line():
    with pytest.raises(ConfigError, match=r"train_batch_size=128 cannot be split over 3 rank\(s\) with "
                       r"gradient_accumulation_steps=4: 128 / \(4 x 3\) = 10\.67 rows per micro-batch; run on 1, 2, "
                       r"4, 8, 16, 32 rank\(s\), or make train_batch_size a multiple of 12"):  # fmt: skip
        adopt_ds_config(REFERENCE_DS_CONFIG, TrainConfig(), 3, on_cpu=True)
    # train_batch_size alone: the run's accumulation where it divides, else DeepSpeed's 1.
    assert adopt_ds_config({"train_batch_size": 64}, TrainConfig(grad_accum=2), 4, on_cpu=True).config.micro_batch == 8
    alone = adopt_ds_config({"train_batch_size": 12}, TrainConfig(grad_accum=8), 4, on_cpu=True).config
    assert (alone.micro_batch, alone.grad_accum) == (3, 1)
    # With the micro batch given, the accumulation is derived.
    derived = adopt_ds_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, TrainConfig(), 2,
                              on_cpu=True).config  # fmt: skip
    assert derived.grad_accum == 8


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        # Python 3.13 points at the trailing comma (column 25), earlier ones at the name missing after it (26).
        ('{"train_batch_size": 128,}', r"ds\.json: not valid JSON \(line 1 column 2[56]: "),
        ('{"train_batch_size": 8, "train_batch_size": 16}', r"key\(s\) \['train_batch_size'\] appear twice"),
        ("[1, 2]", r"holds a list, expected a JSON object"),
        ('{"zero_optimization": {"stage": 2, "overlap_com": true}}',
         r"DeepSpeed config ds\.json: DeepSpeed rejects it: zero_optimization\.overlap_com: Extra inputs are not "
         r"permitted \(got True\)"),
        ('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}',
         r"DeepSpeed rejects it: zero_optimization\.offload_optimizer\.device: Input should be 'none', 'cpu' or "
         r"'nvme' \(got 'gpu'\)"),
        ('{"train_micro_batch_size_per_gpu": "2"}', r"train_micro_batch_size_per_gpu='2' must be a positive integer"),
        ('{"optimizer": {"type": "Lamb"}, "scheduler": {"type": "OneCycle"}}',
         r"optimizer type 'Lamb': the loop trains with AdamW .*; scheduler type 'OneCycle': the loop's schedules "
         r"express WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ('{"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}}',
         r"optimizer\.params\.adam_w_mode=false: the loop's AdamW has true"),
        ('{"optimizer": {"params": {"lr": -1}}}', r"TrainConfig\.lr=-1 is invalid.*\(adopted: lr from optimizer"),
        ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', r"bf16 and fp16 are both enabled"),
        # DeepSpeed drops an unknown top-level key without a word (inside a block its parser refuses one).
        ('{"trian_batch_size": 8, "zero_optimization": {"stage": 2}}',
         r"DeepSpeed config ds\.json: unknown top-level key 'trian_batch_size': DeepSpeed reads no such key \(did "
         r"you mean 'train_batch_size' or 'train_micro_batch_size_per_gpu'\? fix or remove it\)$"),
        ('{"zero_optimisation": {"stage": 2}, "bf16": {"enabled": true}}',
         r"unknown top-level key 'zero_optimisation'.*did you mean 'zero_optimization'"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe",
         r"DeepSpeed config .*ds\.json: not UTF-8 text \(byte 0: invalid start byte; a binary file\?\)"),
    ],
)  # fmt: skip
def test_bad_files_are_one_line(tmp_path, text, pattern):
    path = tmp_path / "ds.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=pattern) as err:
        adopt_ds_config(path, TrainConfig(), 1, on_cpu=True)
    assert "\n" not in str(err.value)


def test_top_level_keys_deepspeed_reads_are_kept_though_the_loop_does_not_use_them():
    """The known keys come from the installed DeepSpeed: its parser's lookups and those of deepspeed.initialize
    (sequence_parallel_size: only initialize reads it), so a key of a feature the loop leaves alone passes through."""
    kept = {"wall_clock_breakdown": True, "tensorboard": {"enabled": False}, "comms_logger": {"enabled": False},
            "sequence_parallel_size": 1, "bfloat16": {"enabled": False}}  # fmt: skip
    ds = adopt_ds_config(kept, TrainConfig(), 1, on_cpu=True).ds_config
    assert {k: ds[k] for k in kept} == kept


def test_known_keys_are_found_once_deepspeed_imports_again(monkeypatch):
    """Without DeepSpeed nothing is checked; that answer is not kept once DeepSpeed imports again (the keys are)."""
    import sys

    from trainloop import ds_config

    monkeypatch.setattr(ds_config, "_minimal", [])
    with monkeypatch.context() as hidden:
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            hidden.delitem(sys.modules, name)
        hidden.setitem(sys.modules, "deepspeed", None)
        assert ds_config.deepspeed_top_level_keys() is None
        adopt_ds_config({"trian_batch_size": 8}, TrainConfig(), 1, on_cpu=True)  # nothing to check it against
    assert "train_batch_size" in ds_config.deepspeed_top_level_keys()
    with pytest.raises(ConfigError, match="unknown top-level key 'trian_batch_size'"):
        adopt_ds_config({"trian_batch_size": 8}, TrainConfig(), 1, on_cpu=True)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"DeepSpeed config .*nope\.json: cannot read it \(No such file"):
        adopt_ds_config(tmp_path / "nope.json", TrainConfig(), 1, on_cpu=True)


def _deepspeed_lrs(kind, params, lr, steps):
    """The learning rate DeepSpeed's own scheduler gives each step (last_batch_iteration = step)."""
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = getattr(lr_schedules, kind)(opt, **params)
    out = []
    for s in range(steps):
        sched.step(s)
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize(
    ("kind", "params", "schedule"),
    [
        ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=2e-3, warmup_num_steps=10), "constant"),
        ("WarmupDecayLR", dict(warmup_min_lr=1e-5, warmup_max_lr=2e-3, warmup_num_steps=10, total_num_steps=60),
         "wsd"),
        ("WarmupCosineLR", dict(warmup_min_ratio=0.05, cos_min_ratio=0.05, warmup_num_steps=10, total_num_steps=60),
         "cosine"),
    ],
)  # fmt: skip
def test_schedulers_become_the_loops_schedule_with_deepspeeds_curve(kind, params, schedule):
    params = dict(params, warmup_type="linear")
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": {"type": kind, "params": params}}
    cfg = adopt_ds_config(ds, TrainConfig(lr=1e-3, max_steps=100), 1, on_cpu=True).config
    assert cfg.schedule == schedule and cfg.warmup_steps == 10 and cfg.lr == 2e-3
    # Up to step 60, the total: past it DeepSpeed 0.17's WarmupCosineLR rises again, ours stays at min_lr.
    ours = [lr_at(s, cfg) for s in range(62)]
    theirs = _deepspeed_lrs(kind, params, 2e-3, 61)
    if kind == "WarmupCosineLR":  # same curve, DeepSpeed's decay one step earlier (the line says so)
        assert ours[:10] == pytest.approx(theirs[:10], rel=1e-12)
        assert ours[11:61] == pytest.approx(theirs[10:60], rel=1e-12)
    else:
        assert ours[:61] == pytest.approx(theirs, rel=1e-12)


def test_log_warmup_and_ignored_optimizer_params_are_said():
    ds = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}}}  # fmt: skip
    line = adopt_ds_config(ds, TrainConfig(), 1, on_cpu=True).line
    assert "its warmup is linear here (DeepSpeed's warmup_type 'log' has no counterpart)" in line
    assert "optimizer params ['torch_adam'] ignored" in line


def test_engine_config_needs_agreement_on_what_deepspeed_runs():
    # The Trainer's side: batch and precision must agree with the TrainConfig (adopt first), in one error.
    with pytest.raises(ConfigError) as err:
        build_ds_config(REFERENCE_DS_CONFIG | {"bf16": {"enabled": True}}, TrainConfig(micro_batch=8, grad_accum=4),
                        2, on_cpu=True)  # fmt: skip
    msg = str(err.value)
    assert "micro_batch: 16 from train_batch_size 128 / (4 x 2 ranks) vs 8 from TrainConfig.micro_batch" in msg
    assert "precision: bf16 from bf16.enabled vs fp32 from TrainConfig.precision" in msg
    assert "trainloop.adopt_ds_config" in msg
    with pytest.raises(ConfigError, match="fp16.*does not work with DeepSpeed on CPU"):
        build_ds_config({}, TrainConfig(precision="fp16"), 1, on_cpu=True)
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage=4: allowed values are 0, 1, 2, 3"):
        build_ds_config({"zero_optimization": {"stage": 4}}, TrainConfig(), 1, on_cpu=True)
    # Optimizer, schedule and clipping values the TrainConfig overrides are used from the TrainConfig, and said.
    ds, notes = build_ds_config(REFERENCE_DS_CONFIG | {"gradient_clipping": 0.5}, TrainConfig(micro_batch=16,
                                grad_accum=4), 2, on_cpu=True)  # fmt: skip
    assert ds["gradient_clipping"] == 0.0 and "optimizer" not in ds and len(notes) == 1
    assert "not used, the run's TrainConfig differs: clip 1.0 rather than 0.5 from gradient_clipping;" in notes[0]


def test_source_dict_is_not_modified():
    src = copy.deepcopy(REFERENCE_DS_CONFIG)
    adopt_ds_config(src, TrainConfig(), 2, on_cpu=True)
    assert src == REFERENCE_DS_CONFIG


@pytest.mark.slow
def test_zero2_offload_trains_and_resumes_with_the_fused_adamw_on_the_host(tmp_path):
    """2 gloo ranks, ZeRO-2 with offload_optimizer: the reference config (lr raised so that 6 steps show learning)."""
    ds = copy.deepcopy(REFERENCE_DS_CONFIG)
    ds["optimizer"]["params"]["lr"] = 1e-2
    args = {"run_dir": str(tmp_path / "a"), "steps": 6, "save_every": 3, "ds_config": ds}
    first = tagged(run("ds_offload.py", args, nproc=2), "RESULT")
    # torch's fused AdamW steps the fp32 partitions on the host (benchmarks/bench_optimizer.py chose it).
    want = "torch.optim.adamw.AdamW"
    assert first["optimizer"] == want and first["fused"] == [True, True] and first["state_devices"] == ["cpu"]
    assert first["micro_batch"] == 16 and first["steps"] == [1, 2, 3, 4, 5, 6]
    assert first["loss"][-1] < first["loss"][0] - 0.05, first["loss"]
    assert len(first["notes"]) == 1
    assert "the loop builds torch AdamW (fused, on the host for offload_optimizer cpu)" in first["notes"][0]
    # Resume from step 3 on 2 ranks: steps 4-6 as in the uninterrupted run (stated bound 1e-6 relative).
    resumed = tmp_path / "b"
    shutil.copytree(tmp_path / "a", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    again = tagged(run("ds_offload.py", {**args, "run_dir": str(resumed), "resume": True}, nproc=2), "RESULT")
    assert again["optimizer"] == want and again["steps"] == [1, 2, 3, 4, 5, 6]
    assert again["loss"][3:] == pytest.approx(first["loss"][3:], rel=1e-6), (first["loss"], again["loss"])
