import re
import subprocess
import sys

import pytest

from lmcore import ModelConfig, estimate_memory, flops_per_token, n_params
from lmcore.estimate_cli import main
from lmcore.memory import GIB, ZeroSettings, activation_bytes, largest_parameter, persistent_parameters

XL = ModelConfig.from_preset("1.3b")


def test_mixed_precision_adam_is_16_bytes_per_parameter_without_zero():
    est = estimate_memory(XL, 1, 1024, "bf16", zero_stage=0, world_size=16)
    psi = n_params(XL)
    assert (est.parameters, est.gradients, est.optimizer_states) == (2 * psi, 2 * psi, 12 * psi)
    fp32 = estimate_memory(XL, 1, 1024, "fp32")
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_states) == (4 * psi, 4 * psi, 8 * psi)


@pytest.mark.parametrize("n", [1, 4, 16, 64])
def test_zero2_gpu_states_are_deepspeeds_2_psi_plus_18_psi_over_n(n):
    """16-bit parameters; 16-bit and fp32 gradient partitions; fp32 master, Adam m and v partitions."""
    psi = n_params(XL)
    est = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=n)
    assert est.parameters == 2 * psi
    assert est.gradients == 2 * psi // n + 4 * psi // n
    assert est.optimizer_states == 3 * (4 * psi // n)
    off = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=n, offload_optimizer=True)
    assert off.model_states == 2 * psi  # only the 16-bit parameters stay on the GPU


def test_zero1_keeps_the_full_16_bit_gradients_and_zero3_gathers_the_largest_parameter():
    psi, n = n_params(XL), 16
    zero1 = estimate_memory(XL, 2, 1024, "bf16", zero_stage=1, world_size=n)
    assert zero1.gradients == 2 * psi + 4 * psi // n
    zero3 = estimate_memory(XL, 2, 1024, "bf16", zero_stage=3, world_size=n)
    assert zero3.parameters == 2 * psi // n + 4 * largest_parameter(XL) and zero3.gradients == 4 * psi // n
    assert largest_parameter(XL) == XL.vocab_size * XL.d_model  # the embedding, 32000 x 2048
    fp32 = estimate_memory(XL, 2, 1024, "fp32", zero_stage=2, world_size=n)
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_states) == (4 * psi, 4 * psi // n, 8 * psi // n)


def test_offload_moves_the_fp32_gradients_master_weights_and_adam_to_the_host():
    psi, n = n_params(XL), 16
    on_gpu = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=n)
    off = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=n, offload_optimizer=True)
    assert off.optimizer_states == 0 and off.gradients == 0 and on_gpu.host_offload == 0
    # fp32 gradients, master, m, v (16 psi / n) + the 16-bit upload copy (2 psi / n) + the largest-parameter buffer
    assert off.host_offload == 16 * psi // n + 2 * psi // n + 2 * largest_parameter(XL)
    accumulating = estimate_memory(
        XL, 2, 1024, "bf16", zero_stage=2, world_size=n, offload_optimizer=True, gradient_accumulation_steps=4
    )
    assert accumulating.host_offload - off.host_offload == 2 * psi // n
    assert off.host_startup == 4 * psi  # each process builds the fp32 model on the host first
    assert off.host_per_node(4) == 4 * max(off.host_startup, off.host_offload)
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        estimate_memory(XL, 2, 1024, zero_stage=0, offload_optimizer=True)
    with pytest.raises(ValueError, match="gpus_per_node must be a positive int, got 0"):
        off.host_per_node(0)


def _deepspeed_estimators():
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed): its estimator is the yardstick")
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


@pytest.mark.parametrize("preset", ["125m", "1.3b"])
@pytest.mark.parametrize("nodes, gpus_per_node", [(1, 1), (1, 4), (1, 8), (4, 4)])
def test_gpu_model_states_equal_deepspeeds_zero2_and_zero3_estimators(preset, nodes, gpus_per_node):
    zero2, zero3 = _deepspeed_estimators()
    cfg = ModelConfig.from_preset(preset)
    psi, n = n_params(cfg), nodes * gpus_per_node
    for offload in (False, True):
        est = estimate_memory(cfg, 1, 128, "bf16", zero_stage=2, world_size=n, offload_optimizer=offload)
        _, ds_gpu = zero2(psi, num_gpus_per_node=gpus_per_node, num_nodes=nodes, cpu_offload=offload)
        assert est.model_states == ds_gpu, (offload, est.model_states, ds_gpu)
        est3 = estimate_memory(cfg, 1, 128, "bf16", zero_stage=3, world_size=n, offload_optimizer=offload)
        _, ds_gpu3, _ = zero3(
            psi, largest_parameter(cfg), gpus_per_node, nodes, cpu_offload=offload, cpu_offload_params=False
        )
        assert est3.model_states == ds_gpu3, (offload, est3.model_states, ds_gpu3)


@pytest.mark.parametrize("gpus_per_node", [1, 2, 4, 8, 16])
def test_host_memory_on_one_node_is_deepspeeds_zero2_estimate_without_its_1_5_buffer_factor(gpus_per_node):
    """DeepSpeed: 1.5 * max(4 * gpus, 16) * psi with offload, 1.5 * 4 * gpus * psi without: the larger of the
    processes' fp32 start-up copies (4 psi each) and the offloaded states (16 psi over the node). Deliberate
    difference: this estimate counts the buffers DeepSpeed 0.19 allocates (the 16-bit upload copy, 2 psi / N, and
    the largest-parameter buffer) instead of a 1.5 margin; where the states are the larger term (up to 4 GPUs) it
    lies between DeepSpeed's unmargined 16 psi and its 24 psi."""
    zero2, _ = _deepspeed_estimators()
    psi = n_params(XL)
    for offload in (False, True):
        est = estimate_memory(XL, 1, 128, "bf16", zero_stage=2, world_size=gpus_per_node, offload_optimizer=offload)
        ds_cpu, _ = zero2(psi, num_gpus_per_node=gpus_per_node, num_nodes=1, cpu_offload=offload)
        ours = est.host_per_node(gpus_per_node)
        if not offload or gpus_per_node >= 8:  # the start-up copies are the larger term in both
            assert ours == gpus_per_node * 4 * psi and 1.5 * ours == ds_cpu, (offload, ours, ds_cpu)
        else:
            assert 16 * psi < ours < ds_cpu, (ours, ds_cpu)


def test_multi_node_offload_host_memory_counts_the_nodes_own_processes_not_every_gpu():
    """DeepSpeed's ZeRO-2 offload estimate takes 4 * total_gpus * psi per node; its ZeRO-3 estimate and this one
    count the node's own processes (4 nodes x 4 GPUs: 16 * psi per node, not 64 * psi)."""
    zero2, _ = _deepspeed_estimators()
    psi = n_params(XL)
    est = estimate_memory(XL, 1, 128, "bf16", zero_stage=2, world_size=16, offload_optimizer=True)
    ds_cpu, _ = zero2(psi, num_gpus_per_node=4, num_nodes=4, cpu_offload=True)
    assert ds_cpu == 1.5 * 64 * psi
    assert est.host_per_node(4) == 4 * 4 * psi


def test_activation_formula_korthikanti():
    s, b, h, a, n_layer, v = 1024, 2, XL.d_model, XL.n_head, XL.n_layer, XL.vocab_size
    logits = 6 * s * b * v
    materialised = activation_bytes(XL, b, s, "bf16", "off", fused_attention=False)
    assert materialised == n_layer * s * b * h * (34 + 5 * a * s // h) + logits
    assert activation_bytes(XL, b, s, "bf16", "off") == n_layer * (34 * s * b * h + 4 * a * s * b) + logits
    assert activation_bytes(XL, b, s, "bf16", "attention") == n_layer * 34 * s * b * h + logits
    block = activation_bytes(XL, b, s, "bf16", "block", fused_attention=False)
    assert block == n_layer * 2 * s * b * h + s * b * h * (34 + 5 * a * s // h) + logits
    assert activation_bytes(XL, b, s, "fp32", "off") == 2 * (activation_bytes(XL, b, s, "bf16", "off") - logits) + (
        4 * s * b * v
    )


def test_fused_attention_keeps_no_scores_350m_at_its_recipe():
    """350m, micro-batch 8 x 1024: materialised scores would make 22.8 GiB of activations, the fused kernel 7.9."""
    cfg = ModelConfig.from_preset("350m")
    assert round(activation_bytes(cfg, 8, 1024, "bf16", "off", fused_attention=False) / 2**30, 1) == 22.8
    assert round(activation_bytes(cfg, 8, 1024, "bf16", "off") / 2**30, 1) == 7.9
    assert estimate_memory(cfg, 8, 1024).activations == activation_bytes(cfg, 8, 1024, "bf16", "off")


def test_checkpointing_argument_defaults_to_the_config():
    cfg = ModelConfig.from_preset("1.3b", checkpointing="block")
    assert estimate_memory(cfg, 2, 1024).activations == activation_bytes(cfg, 2, 1024, "bf16", "block")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(precision="fp8"), "precision"),
        (dict(zero_stage=4), "zero_stage"),
        (dict(world_size=0), "world_size"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        estimate_memory(XL, 2, 1024, **kwargs)


def test_cli_prints_the_table_and_the_verdict(capsys):
    assert (
        main(["--preset", "1.3b", "--gpus", "16", "--zero", "0", "2", "--micro-batch", "2", "--seq-len", "1024"]) == 0
    )
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "zero-0" in out and "zero-2" in out and f"{n_params(XL):,}" in out
    zero0 = estimate_memory(XL, 2, 1024, "bf16", zero_stage=0, world_size=16)
    zero2 = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=16)
    assert lines["total"].split()[-2:] == [f"{zero0.total / 2**30:.2f}", f"{zero2.total / 2**30:.2f}"]
    fits = [line for line in out.splitlines() if line.startswith("fits")][0].split()[-2:]
    assert fits == ["NO" if zero0.total > 24 * 2**30 else "yes", "NO" if zero2.total > 24 * 2**30 else "yes"]


def test_cli_prints_host_memory_per_node_and_counts_scores_only_when_asked(capsys):
    argv = ["--preset", "1.3b", "--gpus", "16", "--gpus-per-node", "4", "--zero", "2", "--offload-optimizer"]
    assert main([*argv, "--micro-batch", "2", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    est = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=16, offload_optimizer=True)
    node = [line for line in out.splitlines() if line.startswith("host per node ")][0]
    assert node.split()[-1] == f"{est.host_per_node(4) / 2**30:.2f}" and "fused attention" in out
    assert main([*argv, "--micro-batch", "2", "--seq-len", "1024", "--materialised-attention"]) == 0
    scores = estimate_memory(XL, 2, 1024, "bf16", 2, 16, True, fused_attention=False)
    activations = [line for line in capsys.readouterr().out.splitlines() if line.startswith("activations")][0]
    assert activations.split()[-1] == f"{scores.activations / 2**30:.2f}"


BAD_FLAGS = [
    (["--seq-len", "0"], ["--seq-len", "positive integer", "'0'"]),
    (["--seq-len", "-5"], ["--seq-len", "positive integer", "'-5'"]),
    (["--seq-len", "1k"], ["--seq-len", "positive integer", "'1k'"]),
    (["--micro-batch", "0"], ["--micro-batch", "positive integer"]),
    (["--gpus", "0"], ["--gpus", "positive integer"]),
    (["--gpus", "-16"], ["--gpus", "positive integer"]),
    (["--vocab-size", "0"], ["--vocab-size", "positive integer"]),
    (["--gpu-memory-gib", "0"], ["--gpu-memory-gib", "positive number"]),
    (["--gpu-memory-gib", "-24"], ["--gpu-memory-gib", "positive number"]),
    (["--gpu-memory-gib", "inf"], ["--gpu-memory-gib", "finite", "'inf'"]),
    (["--gpu-memory-gib", "nan"], ["--gpu-memory-gib", "finite", "'nan'"]),
    (["--zero", "4"], ["--zero", "invalid choice", "4"]),
    (["--precision", "fp8"], ["--precision", "invalid choice", "fp8"]),
    (["--checkpointing", "full"], ["--checkpointing", "invalid choice", "full"]),
    (["--zero", "0", "--offload-optimizer"], ["--offload-optimizer", "ZeRO stage >= 1"]),
    (["--zero"], ["--zero", "expected at least one argument"]),
    (["--gpus", "16", "--nodes", "4"], ["unrecognized arguments", "--nodes"]),
    (["--gpus", "16", "--gpus-per-node", "3"], ["--gpus-per-node 3 must divide --gpus 16"]),
    (["--grad-accum", "0"], ["--grad-accum", "positive integer"]),
    (["--zero", "2", "--offload-param", "cpu"], ["--offload-param", "need --zero 3 alone"]),
    (["--zero", "2", "3", "--offload-optimizer", "nvme"], ["--offload-optimizer nvme need --zero 3 alone"]),
    (["--zero", "3", "--offload-param", "disk"], ["--offload-param", "invalid choice", "disk"]),
    (["--zero", "3", "--max-in-cpu", "-1"], ["ZeroSettings.max_in_cpu must be an int >= 0, got -1"]),
]


@pytest.mark.parametrize("argv, words", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_cli_rejects_bad_flags_with_one_line_and_status_2(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "1.3b", *argv])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("lmcore-estimate: error: ")
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize("argv, words", [([], ["--preset", "required"]), (["--preset", "13b"], ["invalid choice"])])
def test_cli_names_a_missing_or_unknown_preset(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and line.startswith("lmcore-estimate: error: ")
    assert all(word in line for word in words), line


def test_the_command_exits_2_without_a_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "lmcore.estimate_cli", "--preset", "1.3b", "--seq-len", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "lmcore-estimate: error: argument --seq-len: expected a positive integer, got '0'"
    )


def test_cli_prints_the_gathered_pinned_and_nvme_rows_for_zero3_offload(capsys):
    argv = ["--preset", "2.7b", "--gpus", "32", "--gpus-per-node", "4", "--zero", "3", "--offload-optimizer", "nvme",
            "--offload-param", "cpu"]  # fmt: skip
    assert main(argv) == 0
    rows = {line[:18].strip(): line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    big = ModelConfig.from_preset("2.7b")
    est = estimate_memory(big, 1, 1024, zero_stage=3, world_size=32, offload_optimizer="nvme", offload_param="cpu")
    assert rows["NVMe per node"] == f"{est.nvme_per_node(4) / 2**30:.2f}" != "0.00"
    assert rows["host pinned"] == f"{est.host_pinned / 2**30:.2f}" and rows["gathered"] == f"{est.gathered / 2**30:.2f}"
    assert main([*argv[:-1], "nvme", "--max-in-cpu", "0"]) == 0  # the parameter partitions on the drive too
    rows = {line[:18].strip(): line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    on_drive = estimate_memory(big, 1, 1024, zero_stage=3, world_size=32, offload_optimizer="nvme",
                               offload_param="nvme", zero=ZeroSettings(max_in_cpu=0))  # fmt: skip
    assert rows["NVMe per node"] == f"{on_drive.nvme_per_node(4) / 2**30:.2f}" and on_drive.nvme > est.nvme


def test_cli_reports_the_training_flops_per_token(capsys):
    assert main(["--preset", "1.3b", "--zero", "2", "--seq-len", "2048"]) == 0
    expected = flops_per_token(XL, 2048)
    assert f"training FLOPs per token at 2048 tokens: {expected:.4g}" in capsys.readouterr().out
    assert expected == 6 * n_params(XL) + 12 * 24 * 16 * 128 * 2048


def test_fsdp_estimate_shards_the_model_states_and_counts_the_blocks_in_flight():
    from lmcore import GPT
    from lmcore.memory import block_parameters, estimate_fsdp_memory

    cfg = ModelConfig.from_preset("tiny")
    model = GPT(cfg)
    block, root = block_parameters(cfg)
    assert block == sum(p.numel() for p in model.layers[0].parameters())
    assert root == sum(p.numel() for p in model.parameters()) - cfg.n_layer * block
    big = ModelConfig.from_preset("1.3b")
    psi = n_params(big)
    one, sixteen = (estimate_fsdp_memory(big, 2, 1024, "bf16", world_size=n) for n in (1, 16))
    # fp32 weights, fp32 gradients and Adam's two moments, 16 bytes per parameter, split over the ranks
    assert one.optimizer_states == 8 * psi and sixteen.optimizer_states == 8 * psi // 16
    block, root = block_parameters(big)
    assert sixteen.parameters == 4 * psi // 16
    # Two bf16 blocks and the root gathered, one block's gradient in bf16 and its fp32 copy for the reduce-scatter.
    assert sixteen.gathered == 2 * (2 * block + root) + 2 * block + 4 * block
    accum = estimate_fsdp_memory(big, 2, 1024, "bf16", world_size=16, gradient_accumulation_steps=4)
    assert accum.gradients - sixteen.gradients == 4 * psi  # unsharded fp32 gradients kept between syncs
    every = estimate_fsdp_memory(big, 2, 1024, "bf16", world_size=16, gradient_accumulation_steps=4,
                                 sync_every_micro_batch=True)  # fmt: skip
    assert every.gradients == sixteen.gradients
    offload = estimate_fsdp_memory(big, 2, 1024, "bf16", world_size=16, cpu_offload=True)
    assert offload.optimizer_states == 0 and offload.host_offload == 16 * psi // 16
    assert offload.host_pinned == 8 * psi // 16 and offload.gathered == sixteen.gathered  # shards pinned, not Adam's
    with pytest.raises(ValueError, match="fp16 needs a sharded loss scaler"):
        estimate_fsdp_memory(big, 2, 1024, "fp16")


# --------------------------------------------------------------------------------- offload and DeepSpeed's yardstick
def _largest_layer(cfg):
    """DeepSpeed's "largest layer": the most parameters one module holds itself (its `model_to_params`), counted on
    the meta device (DeepSpeed's own helper dedupes by data pointer, which the meta device does not have)."""
    import torch

    from lmcore import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


# (our configuration, DeepSpeed's estimator arguments): every configuration both estimate.
CONFIGS = {
    "zero2": (dict(zero_stage=2), (2, dict(cpu_offload=False))),
    "zero2 + optimizer offload": (dict(zero_stage=2, offload_optimizer="cpu"), (2, dict(cpu_offload=True))),
    "zero3": (dict(zero_stage=3), (3, dict(cpu_offload=False, cpu_offload_params=False))),
    "zero3 + optimizer offload": (dict(zero_stage=3, offload_optimizer="cpu"),
                                  (3, dict(cpu_offload=True, cpu_offload_params=False))),
    "zero3 + parameter offload": (dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
                                  (3, dict(cpu_offload=True, cpu_offload_params=True))),
}  # fmt: skip


@pytest.mark.parametrize("preset", ["1.3b", "2.7b"])
@pytest.mark.parametrize("world", [16, 32])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_is_within_5_percent_of_deepspeeds_estimators(preset, world, name):
    """GPU bytes of model states (DeepSpeed's terms: partitions and the largest layer gathered with its gradient) and
    host bytes per node, 4 GPUs per node, against `estimate_zero2/3_model_states_mem_needs` (what their `_all_cold`
    tables print) without DeepSpeed's 1.5 margin, ZeRO-3 without `zero.Init` (lmtrain builds the model on the host
    first). One documented exception: DeepSpeed's ZeRO-2 offload host estimate multiplies by every GPU of the job."""
    zero2, zero3 = _deepspeed_estimators()
    cfg = ModelConfig.from_preset(preset)
    psi, largest, per_node = n_params(cfg), _largest_layer(cfg), 4
    assert largest == largest_parameter(cfg)  # the token embedding
    ours_kw, (stage, ds_kw) = CONFIGS[name]
    est = estimate_memory(cfg, 1, 1024, "bf16", world_size=world, **ours_kw)
    if stage == 2:
        ds_host, ds_gpu = zero2(psi, per_node, world // per_node, additional_buffer_factor=1.0, **ds_kw)
    else:
        ds_host, ds_gpu, _ = zero3(psi, largest, per_node, world // per_node, zero_init=False,
                                   additional_buffer_factor=1.0, **ds_kw)  # fmt: skip
    assert abs(est.model_states - ds_gpu) <= 0.05 * ds_gpu, (est.model_states, ds_gpu)
    ours_host = est.host_per_node(per_node)
    if name == "zero2 + optimizer offload":
        # Theirs: 4 psi for every GPU of the job; ours: the fp32 copies of the node's own 4 processes, the peak.
        assert ds_host == 4 * world * psi and ours_host == per_node * 4 * psi, (ours_host, ds_host)
    else:
        assert abs(ours_host - ds_host) <= 0.05 * ds_host, (ours_host, ds_host)
    if stage == 3 and ds_kw["cpu_offload"]:  # the offloaded states alone: DeepSpeed's figure with zero.Init
        states, _, _ = zero3(psi, largest, per_node, world // per_node, zero_init=True, additional_buffer_factor=1.0,
                             **ds_kw)  # fmt: skip
        assert abs(per_node * est.host_offload - states) <= 0.05 * states, (per_node * est.host_offload, states)
    # Beyond DeepSpeed's terms, ZeRO-3's prefetched and persistent parameters: small next to the model states.
    if stage == 3:
        assert 0 < est.gathered < 0.25 * est.model_states + 2 * 5 * 10**7 + 1


def test_all_cold_prints_the_numbers_compared_above(capsys):
    """The `_all_cold` table (DeepSpeed's printed estimate) holds the figures of the function the test above calls."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    except ImportError:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed): its estimator is the yardstick")
    cfg = ModelConfig.from_preset("2.7b")
    estimate_zero3_model_states_mem_needs_all_cold(n_params(cfg), largest_parameter(cfg), 4, 8)
    table = capsys.readouterr().out
    est = estimate_memory(
        cfg, 1, 1024, "bf16", zero_stage=3, world_size=32, offload_optimizer="cpu", offload_param="cpu"
    )
    gpu = f"{est.model_states / GIB:.2f}GB"
    row = [
        line for line in table.splitlines() if "offload_param=OffloadDeviceEnum.cpu" in line and "zero_init=0" in line
    ]
    assert len(row) == 1 and gpu in row[0], (gpu, table)
    assert f"{1.5 * est.host_per_node(4) / GIB:.2f}GB" in row[0], table  # theirs carries the 1.5 margin


def test_parameter_offload_moves_the_16_bit_partition_to_the_host_or_the_drive():
    cfg, n = ModelConfig.from_preset("2.7b"), 32
    psi = n_params(cfg)
    on_gpu = estimate_memory(cfg, 1, 1024, "bf16", zero_stage=3, world_size=n, offload_optimizer="cpu")
    cpu = estimate_memory(
        cfg, 1, 1024, "bf16", zero_stage=3, world_size=n, offload_optimizer="cpu", offload_param="cpu"
    )
    assert on_gpu.parameters - cpu.parameters == 2 * psi // n and cpu.parameters == 4 * largest_parameter(cfg)
    assert cpu.host_offload - on_gpu.host_offload == 2 * psi // n == cpu.host_pinned - on_gpu.host_pinned
    # Pinned: the fp32 master weights and gradients; Adam's moments are allocated by the optimizer, unpinned.
    assert on_gpu.host_pinned == 8 * psi // n and on_gpu.host_offload == 16 * psi // n
    unpinned = estimate_memory(cfg, 1, 1024, "bf16", zero_stage=3, world_size=n, offload_optimizer="cpu",
                               offload_param="cpu", zero=ZeroSettings(pin_memory=False))  # fmt: skip
    assert unpinned.host_pinned == 0 and unpinned.host_offload == cpu.host_offload
    # NVMe: by default DeepSpeed keeps up to 1e9 elements in host memory (all of them here), plus 5 pinned buffers
    # of 1e8 elements; with max_in_cpu 0 the partition is on the drive.
    kept = estimate_memory(cfg, 1, 1024, "bf16", zero_stage=3, world_size=n, offload_optimizer="cpu",
                           offload_param="nvme")  # fmt: skip
    assert kept.nvme == 0 and kept.host_offload == on_gpu.host_offload + 2 * psi // n + 2 * 5 * 10**8
    drive = estimate_memory(cfg, 1, 1024, "bf16", zero_stage=3, world_size=n, offload_optimizer="cpu",
                            offload_param="nvme", zero=ZeroSettings(max_in_cpu=0))  # fmt: skip
    assert drive.nvme == 2 * psi // n and drive.host_offload == on_gpu.host_offload + 2 * 5 * 10**8
    assert drive.host_pinned == on_gpu.host_pinned + 2 * 5 * 10**8 and drive.nvme_per_node(4) == 4 * drive.nvme
    assert drive.total == cpu.total  # the GPU sees no difference between host and drive


def test_optimizer_on_nvme_saves_host_memory_only_with_small_sub_groups():
    cfg, n = ModelConfig.from_preset("2.7b"), 32
    psi = n_params(cfg)
    kw = dict(zero_stage=3, world_size=n, offload_param="cpu")
    cpu = estimate_memory(cfg, 1, 1024, "bf16", offload_optimizer="cpu", **kw)
    nvme = estimate_memory(cfg, 1, 1024, "bf16", offload_optimizer="nvme", **kw)
    assert nvme.nvme == 16 * psi // n and nvme.gradients == nvme.optimizer_states == 0
    # 4 pinned fp32 swap buffers of the largest sub-group: by default (1e9 elements) the whole partition.
    assert nvme.host_offload - 2 * psi // n == 4 * 4 * (psi // n) >= cpu.host_offload - 2 * psi // n
    small = estimate_memory(cfg, 1, 1024, "bf16", offload_optimizer="nvme", zero=ZeroSettings(sub_group_size=10**7),
                            **kw)  # fmt: skip
    assert small.host_offload - 2 * psi // n == 4 * 4 * 10**7 and small.nvme == nvme.nvme


def test_zero3_counts_its_prefetched_and_persistent_parameters_as_gathered():
    cfg = ModelConfig.from_preset("1.3b")
    est = estimate_memory(cfg, 2, 1024, "bf16", zero_stage=3, world_size=16)
    assert est.gathered == 2 * (5 * 10**7 + persistent_parameters(cfg))
    assert est.total == est.model_states + est.gathered + est.activations
    smaller = estimate_memory(cfg, 2, 1024, "bf16", zero_stage=3, world_size=16,
                              zero=ZeroSettings(prefetch_bucket_size=10**7))  # fmt: skip
    assert est.gathered - smaller.gathered == 2 * 4 * 10**7
    assert estimate_memory(cfg, 2, 1024, "bf16", zero_stage=2, world_size=16).gathered == 0
    # Norms and biases: 2 norms x (weight, bias) and 6 biases per layer (q, k, v, o, up, down), the final norm.
    d, ff = cfg.d_model, cfg.d_ff
    assert persistent_parameters(cfg) == cfg.n_layer * (4 * d + 5 * d + ff) + 2 * d


def test_zero_settings_come_from_a_deepspeed_config_block():
    block = {"stage": 3, "sub_group_size": 1e8, "stage3_prefetch_bucket_size": 2e7,
             "offload_param": {"device": "nvme", "max_in_cpu": 0, "buffer_count": 6, "pin_memory": False},
             "offload_optimizer": {"device": "cpu", "pin_memory": True}}  # fmt: skip
    zero = ZeroSettings.from_ds_config(block)
    assert (zero.sub_group_size, zero.prefetch_bucket_size, zero.max_in_cpu, zero.param_buffer_count) == (
        10**8, 2 * 10**7, 0, 6)  # fmt: skip
    assert zero.pin_memory is False and ZeroSettings.from_ds_config({}) == ZeroSettings()
    with pytest.raises(ValueError, match="ZeroSettings.max_in_cpu must be an int >= 0, got -1"):
        ZeroSettings(max_in_cpu=-1)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(zero_stage=2, offload_param="cpu"), "offload_param='cpu' needs zero_stage 3"),
        (dict(zero_stage=2, offload_optimizer="nvme"), "offload_optimizer='nvme' needs zero_stage 3"),
        (dict(zero_stage=3, offload_param="disk"), "offload_param must be None, 'cpu' or 'nvme', got 'disk'"),
        (dict(zero_stage=3, offload_optimizer="gpu"), "offload_optimizer must be False, True, 'cpu' or 'nvme'"),
    ],
)
def test_offload_that_the_stage_cannot_do_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        estimate_memory(XL, 2, 1024, world_size=16, **kwargs)
