import pytest

from lmcore import ModelConfig, estimate_memory, n_params
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


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["--preset", "1.3b", "--zero", "0", "--offload-optimizer", "--micro-batch", "0"]) == 2
    assert "micro_batch" in capsys.readouterr().err
