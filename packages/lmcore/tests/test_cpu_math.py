"""lmcore.cpu_math: the bf16 check, the GEMM shapes, the oneDNN-or-MKL probe and its rule, and SDPA kept on MKL."""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lmcore.cpu_math as cpu_math
from lmcore import GPT, ModelConfig, n_params
from lmcore.cpu_math import (
    FP32_ERROR_FLOOR,
    GemmShape,
    MatmulProbe,
    cpu_has_native_bf16,
    cpu_matmul_library,
    model_gemm_shapes,
    probe_matmul_routing,
    route_cpu_matmuls,
    set_cpu_matmul_library,
)

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def matmul_setting_restored():
    saved = torch.backends.mkldnn.matmul.fp32_precision
    yield
    torch.backends.mkldnn.matmul.fp32_precision = saved


def test_native_bf16_from_flags():
    assert cpu_has_native_bf16(["fpu", "avx512f", "avx512_bf16"])
    assert cpu_has_native_bf16(["AMX_BF16"])
    assert not cpu_has_native_bf16(["avx512f", "avx512_fp16", "avx2"])
    with pytest.raises(TypeError, match="not one string"):
        cpu_has_native_bf16("avx512_bf16")


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo to compare with")
def test_native_bf16_detection_agrees_with_proc_cpuinfo():
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert cpu_has_native_bf16() == cpu_has_native_bf16(flags.partition(":")[2].split())


@pytest.mark.parametrize(
    "overrides",
    [dict(bias=False), dict(bias=False, n_kv_head=2, activation="swiglu", norm="rmsnorm", tie_embeddings=False)],
)
def test_gemm_shapes_cover_every_weight_matrix(overrides):
    config = ModelConfig.from_preset("tiny", **overrides)
    tokens = 48
    shapes = model_gemm_shapes(config, tokens)
    norms = (2 * config.n_layer + 1) * config.d_model * (2 if config.norm == "layernorm" and config.bias else 1)
    untied_input = 0 if config.tie_embeddings else config.vocab_size * config.d_model
    weights = n_params(config) - norms - untied_input
    assert sum(s.flops for s in shapes) == 6 * tokens * weights
    assert len({(s.in_features, s.out_features) for s in shapes}) == len(shapes)  # distinct, counts merged


def test_gemm_shapes_reject_bad_input():
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        model_gemm_shapes(ModelConfig.from_preset("tiny"), 0)
    with pytest.raises(TypeError, match="needs|must be a ModelConfig"):
        model_gemm_shapes({"d_model": 64}, 8)


@pytest.mark.parametrize(
    "mkl, onednn, mkl_err, onednn_err, routed, reason",
    [
        (100.0, 250.0, 5e-7, 6e-7, True, "oneDNN: 2.50x"),
        (100.0, 250.0, 5e-7, 3e-3, False, "not fp32's"),  # a bf16 product: faster, refused
        (100.0, 104.0, 5e-7, 6e-7, False, "not faster"),  # under MIN_SPEEDUP
        (100.0, 250.0, 0.0, 2 * FP32_ERROR_FLOOR, False, "not fp32's"),  # bit-exact MKL: the floor still bounds it
    ],
)
def test_the_routing_rule(mkl, onednn, mkl_err, onednn_err, routed, reason):
    decided, why = cpu_math._decision(mkl, onednn, mkl_err, onednn_err)
    assert decided is routed
    assert reason in why


def test_kernel_names_from_the_verbose_log():
    lines = [
        "onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2",
        "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:f32::blocked:ab::f0 "
        "wei:f32::blocked:ba::f0 dst:f32::blocked:ab::f0,attr-scratchpad:user attr-fpmath:bf16,,64x128:128x256,9.9",
        "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core,undef,src:f32::blocked:ab::f0,"
        "attr-scratchpad:user,,64x128:128x256,9.9",
    ]
    assert cpu_math._kernel_names(lines) == ("brg_matmul:avx10_1_512_amx (fpmath bf16)", "brg_matmul:avx512_core")


# torch routes fp32 GEMMs to oneDNN only on an AVX-512 CPU; elsewhere the probe answers MKL without measuring.
needs_avx512 = pytest.mark.skipif(
    not cpu_math.onednn_takes_fp32_gemms(), reason="torch keeps fp32 GEMMs on MKL on a CPU without AVX-512"
)


@needs_avx512
def test_the_probe_measures_both_libraries_and_changes_nothing():
    set_cpu_matmul_library("mkl")
    probe = probe_matmul_routing([GemmShape(128, 64, 96, 2), GemmShape(128, 96, 64)], max_seconds=0.2)
    assert cpu_matmul_library() == "mkl"
    assert probe.mkl_gflops > 0 and probe.onednn_gflops > 0 and probe.probe_s > 0
    assert probe.mkl_error < 1e-5  # fp32 against float64
    decided, reason = cpu_math._decision(probe.mkl_gflops, probe.onednn_gflops, probe.mkl_error, probe.onednn_error)
    assert (probe.routed, probe.reason) == (decided, reason)


@needs_avx512
def test_the_probe_names_the_kernels_it_ran(capfd):
    probe = probe_matmul_routing([GemmShape(64, 64, 64)], max_seconds=0.05, record_kernels=True)
    assert probe.kernels and all("matmul" in k for k in probe.kernels)
    assert "onednn_verbose" not in capfd.readouterr().out  # the log went to the probe, not to stdout


def test_without_avx512_the_probe_answers_mkl_and_measures_nothing(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(cpu_math, "_linear_step", lambda *a, **k: pytest.fail("the probe measured"))
    probe = probe_matmul_routing([GemmShape(64, 64, 64)], max_seconds=0.05)
    assert not probe.routed and "AVX-512" in probe.reason and probe.probe_s == 0


@pytest.mark.parametrize("routed, library", [(True, "onednn"), (False, "mkl")])
def test_route_applies_what_the_probe_decided(monkeypatch, routed, library):
    seen = []

    def fake_probe(shapes, *, max_seconds):
        seen.append(shapes)
        return MatmulProbe(routed, "stand-in")

    monkeypatch.setattr(cpu_math, "probe_matmul_routing", fake_probe)
    config = ModelConfig.from_preset("tiny")
    set_cpu_matmul_library("onednn" if library == "mkl" else "mkl")
    assert route_cpu_matmuls(config, 64).routed is routed
    assert cpu_matmul_library() == library
    assert seen == [model_gemm_shapes(config, 64)]


def test_route_disabled_measures_nothing_and_keeps_mkl(monkeypatch):
    monkeypatch.setattr(cpu_math, "probe_matmul_routing", lambda *a, **k: pytest.fail("probed while disabled"))
    set_cpu_matmul_library("onednn")
    assert not route_cpu_matmuls(ModelConfig.from_preset("tiny"), 64, enabled=False).routed
    assert cpu_matmul_library() == "mkl"


def test_set_library_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="'onednn' or 'mkl'"):
        set_cpu_matmul_library("blas")


class MatmulSettings(TorchDispatchMode):
    """Records the fp32_precision setting in force at every GEMM-like op, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm") or "scaled_dot_product" in name:
            self.seen.append((name, torch.backends.mkldnn.matmul.fp32_precision))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("learnable_slopes", [False, True])  # flash kernel; math path (the bias needs a gradient)
def test_sdpa_keeps_mkl_forward_and_backward_while_the_linears_are_routed(learnable_slopes):
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny", attention_backend="torch", learnable_slopes=learnable_slopes))
    ids = torch.randint(0, 97, (2, 16))
    set_cpu_matmul_library("onednn")
    with MatmulSettings() as mode:
        model(ids, ids).loss.backward()
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # restored after the backward
    linears = {setting for name, setting in mode.seen if name in ("mm", "addmm")}
    attention = {setting for name, setting in mode.seen if name == "bmm" or "scaled_dot_product" in name}
    assert linears == {"bf16"}
    assert attention == {"ieee"}
    backward_attention = [n for n, _ in mode.seen if "backward" in n or n == "bmm"]
    assert backward_attention  # the backward's attention ops were seen too
