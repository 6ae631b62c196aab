"""Which tiles may launch where, decided without a GPU, and what the launch code does with that decision.

The shared bytes behind `launch_configs` come from ahead-of-time compiles (`shared_memory.json`);
tests/test_launch_fit.py recompiles them. Here: every target gets a config for every kernel, dtype and head dim;
the limits are applied; bad arguments name themselves; and the launch code (with the NVIDIA driver faked, the one
thing this machine lacks) prunes the autotuner, falls back past a config that fails to launch, and turns "nothing
fits" into one LaunchConfigError line.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

import alibi_kernels.attention_triton as at
from alibi_kernels.launch_configs import (
    GPU_TARGETS,
    KERNELS,
    LaunchConfigError,
    TileConfig,
    candidate_configs,
    has_measured_tiles,
    launch_configs,
    shared_memory_bytes,
    spill_budget,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 160, 256)


@pytest.mark.parametrize("target", list(GPU_TARGETS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_target_can_launch_every_kernel_at_every_head_dim(target, dtype):
    capability, smem = GPU_TARGETS[target]
    for kernel in KERNELS:
        for d in HEAD_DIMS:
            fitting = launch_configs(kernel, capability=capability, smem_per_block=smem, dtype=dtype, head_dim=d)
            assert fitting, (kernel, d)
            for config in fitting:
                needed = shared_memory_bytes(kernel, config, capability=capability, dtype=dtype, head_dim=d)
                assert needed <= smem, (kernel, d, config, needed)


def test_the_limit_is_applied_per_target():
    """A config is returned exactly when its measured bytes fit: the forward's first 16-bit tile at D=128 needs 96 KiB
    on sm_80..89 (a 3090 has 99 KiB) and 128 KiB on sm_90 (wgmma keeps q in shared memory)."""
    first = candidate_configs("fwd", torch.bfloat16, 128)[0]
    kwargs = {"dtype": torch.bfloat16, "head_dim": 128}
    for capability in [(8, 6), (9, 0)]:
        needed = shared_memory_bytes("fwd", first, capability=capability, **kwargs)
        assert first in launch_configs("fwd", capability=capability, smem_per_block=needed, **kwargs)
        assert first not in launch_configs("fwd", capability=capability, smem_per_block=needed - 1, **kwargs)
    assert shared_memory_bytes("fwd", first, capability=(8, 6), **kwargs) == 98304
    assert shared_memory_bytes("fwd", first, capability=(9, 0), **kwargs) == 131072
    assert launch_configs("fwd", capability=(8, 6), smem_per_block=1024, **kwargs) == []


def test_candidates_are_distinct_and_the_spill_budget_is_zero_but_for_the_stated_cases():
    for kernel in KERNELS:
        for dtype in DTYPES:
            for d in (64, 128, 256):
                configs = candidate_configs(kernel, dtype, d)
                # fp32 dK/dV at D=256: only two tiles fit and spill nothing under every Triton measured (launch_configs)
                fewest = 2 if (kernel, dtype, d) == ("dkdv", torch.float32, 256) else 3
                assert len(set(configs)) == len(configs) >= fewest, (kernel, dtype, d)
                for capability in [(8, 6), (8, 9), (9, 0)]:
                    assert spill_budget(kernel, dtype, d, capability) == 0
                assert spill_budget(kernel, dtype, d, (8, 0)) == (0 if kernel == "fwd" else 64)
                assert spill_budget(kernel, dtype, 80, (9, 0)) == (0 if kernel == "fwd" else 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kernel": "bwd"}, r"kernel must be one of \('fwd', 'dkdv', 'dq'\), got 'bwd'"),
        ({"dtype": torch.float64}, r"dtype must be torch.float16, torch.bfloat16 or torch.float32, got torch.float64"),
        ({"head_dim": 8}, r"head_dim must be an int in 16..256, got 8"),
        ({"capability": (7, 5)}, r"capability 7.5 has no measured tiles .* backend='torch'"),
        ({"capability": "sm_86"}, r"capability must be a \(major, minor\) tuple of ints such as \(8, 6\), got 'sm_86'"),
        ({"smem_per_block": 0}, r"smem_per_block must be a positive int of bytes \(101376 on sm_86\), got 0"),
    ],
)
def test_bad_arguments_raise_one_line_naming_the_value(kwargs, message):
    args = {"kernel": "fwd", "capability": (8, 6), "smem_per_block": 101376, "dtype": torch.float16, "head_dim": 64}
    args.update(kwargs)
    kernel = args.pop("kernel")
    with pytest.raises(ValueError, match=message) as info:
        launch_configs(kernel, **args)
    assert "\n" not in str(info.value)


def test_has_measured_tiles():
    assert all(has_measured_tiles(c) for c in [(8, 0), (8, 6), (8, 9), (9, 0)])
    assert not has_measured_tiles((10, 0)) and not has_measured_tiles((7, 5))


# ---------------------------------------------------------------- the launch code, with a faked driver
class FakeKernel:
    """Stands in for a compiled Triton kernel: records each launch's tile, fails those in `too_big`."""

    def __init__(self, too_big=()):
        self.too_big, self.launched = set(too_big), []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            tile = TileConfig(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"])
            if tile in self.too_big:
                raise OutOfResources(300000, 101376, "shared memory")
            self.launched.append(tile)

        return launch


@pytest.fixture
def rtx3090(monkeypatch):
    """A compiled-mode launcher on an RTX 3090, without autotuning."""
    monkeypatch.setattr(at, "INTERPRETED", False)
    monkeypatch.setattr(at, "_device_limits", lambda device: ((8, 6), 101376, "NVIDIA GeForce RTX 3090"))
    monkeypatch.setenv("ALIBI_KERNELS_AUTOTUNE", "0")
    monkeypatch.setattr(at, "_picked", {})
    return monkeypatch


def constants(d):
    return {"HEAD_DIM": d, "BLOCK_D": d, "IS_CAUSAL": True, "VARLEN": False, "UPCAST": False, "DOT_PRECISION": "ieee"}


def test_without_autotuning_the_best_fitting_config_launches_and_is_remembered(rtx3090):
    fake = FakeKernel()
    rtx3090.setitem(at.RAW_KERNELS, "fwd", fake)
    q = torch.empty(1, 1, 1, 128)
    at._launch("fwd", None, (q,), constants(128), torch.bfloat16)
    first = launch_configs("fwd", capability=(8, 6), smem_per_block=101376, dtype=torch.bfloat16, head_dim=128)[0]
    assert fake.launched == [first] and first == candidate_configs("fwd", torch.bfloat16, 128)[0]


def test_a_config_that_fails_to_launch_is_skipped(rtx3090):
    fitting = launch_configs("dkdv", capability=(8, 6), smem_per_block=101376, dtype=torch.float32, head_dim=256)
    fake = FakeKernel(too_big=fitting[:1])  # another Triton version might allocate more than the table says
    rtx3090.setitem(at.RAW_KERNELS, "dkdv", fake)
    at._launch("dkdv", None, (torch.empty(1),), constants(256), torch.float32)
    at._launch("dkdv", None, (torch.empty(1),), constants(256), torch.float32)
    assert fake.launched == [fitting[1], fitting[1]]  # the second call goes straight to the config that ran


def test_nothing_fitting_is_one_launch_config_error_naming_device_shape_and_fix(rtx3090):
    rtx3090.setattr(at, "_device_limits", lambda device: ((8, 6), 16384, "NVIDIA GeForce RTX 3090"))
    with pytest.raises(LaunchConfigError) as info:
        at._launch("dkdv", None, (torch.empty(1),), constants(256), torch.float32)
    message = str(info.value)
    assert "\n" not in message
    for part in ("dkdv", "NVIDIA GeForce RTX 3090", "sm_86", "16384 bytes", "torch.float32", "head dim 256"):
        assert part in message, part
    assert "backend='torch'" in message


def test_every_config_failing_at_launch_is_the_same_error(rtx3090):
    fitting = launch_configs("fwd", capability=(8, 6), smem_per_block=101376, dtype=torch.float16, head_dim=64)
    rtx3090.setitem(at.RAW_KERNELS, "fwd", FakeKernel(too_big=fitting))
    with pytest.raises(LaunchConfigError, match="no fwd tile fits NVIDIA GeForce RTX 3090"):
        at._launch("fwd", None, (torch.empty(1),), constants(64), torch.float16)


def test_the_autotuner_is_pruned_to_the_configs_that_fit(rtx3090):
    """On a device with 90000 bytes per block the forward's first 16-bit tile at D=128 (98304 bytes) is dropped."""
    import triton

    rtx3090.setattr(at, "_device_limits", lambda device: ((8, 6), 90000, "a smaller sm_86 GPU"))
    configs = [
        triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in candidate_configs("fwd", torch.bfloat16, 128)
    ]
    kept = at._prune("fwd", torch.bfloat16, 128)(configs, {"Q": torch.empty(1)})
    expected = launch_configs("fwd", capability=(8, 6), smem_per_block=90000, dtype=torch.bfloat16, head_dim=128)
    assert [at._tile_of(c) for c in kept] == expected and len(kept) == len(configs) - 1
