import subprocess
import sys

import pytest

from lmcore import ModelConfig, estimate_memory, flops_per_token, n_params
from lmcore.estimate_cli import main
from lmcore.memory import activation_bytes

XL = ModelConfig.from_preset("1.3b")


def test_mixed_precision_adam_is_16_bytes_per_parameter_without_zero():
    est = estimate_memory(XL, 1, 1024, "bf16", zero_stage=0, world_size=16)
    psi = n_params(XL)
    assert (est.parameters, est.gradients, est.optimizer_states) == (2 * psi, 2 * psi, 12 * psi)
    fp32 = estimate_memory(XL, 1, 1024, "fp32")
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_states) == (4 * psi, 4 * psi, 8 * psi)


@pytest.mark.parametrize(
    "stage, sharded",
    [
        (1, {"optimizer_states"}),
        (2, {"optimizer_states", "gradients"}),
        (3, {"optimizer_states", "gradients", "parameters"}),
    ],
)
def test_each_zero_stage_divides_its_states_by_world_size(stage, sharded):
    base = estimate_memory(XL, 2, 1024, "bf16", zero_stage=0, world_size=16)
    est = estimate_memory(XL, 2, 1024, "bf16", zero_stage=stage, world_size=16)
    for field in ("parameters", "gradients", "optimizer_states"):
        expected = getattr(base, field) // 16 if field in sharded else getattr(base, field)
        assert getattr(est, field) == expected, field
    assert est.activations == base.activations  # data parallelism does not split activations


def test_offload_moves_the_sharded_optimizer_states_to_cpu():
    on_gpu = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=16)
    off = estimate_memory(XL, 2, 1024, "bf16", zero_stage=2, world_size=16, offload_optimizer=True)
    assert off.optimizer_states == 0 and off.cpu_optimizer_states == on_gpu.optimizer_states
    assert on_gpu.total - off.total == on_gpu.optimizer_states
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        estimate_memory(XL, 2, 1024, zero_stage=0, offload_optimizer=True)


def test_activation_formula_korthikanti():
    s, b, h, a, n_layer, v = 1024, 2, XL.d_model, XL.n_head, XL.n_layer, XL.vocab_size
    logits = 6 * s * b * v
    assert activation_bytes(XL, b, s, "bf16", "off") == n_layer * s * b * h * (34 + 5 * a * s // h) + logits
    assert activation_bytes(XL, b, s, "bf16", "attention") == n_layer * 34 * s * b * h + logits
    block = activation_bytes(XL, b, s, "bf16", "block")
    assert block == n_layer * 2 * s * b * h + s * b * h * (34 + 5 * a * s // h) + logits
    assert activation_bytes(XL, b, s, "fp32", "off") == 2 * (activation_bytes(XL, b, s, "bf16", "off") - logits) + (
        4 * s * b * v
    )


def test_checkpointing_argument_defaults_to_the_config():
    cfg = ModelConfig.from_preset("1.3b", checkpointing="block")
    assert estimate_memory(cfg, 2, 1024).activations == activation_bytes(cfg, 2, 1024, "bf16", "block")


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(precision="fp8"), "precision"), (dict(zero_stage=4), "zero_stage"), (dict(world_size=0), "world_size")],
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


def test_cli_reports_the_training_flops_per_token(capsys):
    assert main(["--preset", "1.3b", "--zero", "2", "--seq-len", "2048"]) == 0
    expected = flops_per_token(XL, 2048)
    assert f"training FLOPs per token at 2048 tokens: {expected:.4g}" in capsys.readouterr().out
    assert expected == 6 * n_params(XL) + 12 * 24 * 16 * 128 * 2048
