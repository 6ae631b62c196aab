"""Which tile configs each Triton kernel may launch on a given GPU, decided without a GPU.

Every kernel ("fwd", "dkdv", "dq") has a short list of candidate tiles per dtype and head-dim class, best first.
A config launches only if its shared memory fits the device's opt-in limit per block; Triton scores a config that
fails as infinitely slow and, when every config fails, launches config 0 and raises "out of resources". The shared
bytes of every candidate were measured by compiling it ahead of time with the arguments this package's launch code
passes (`alibi_kernels.compile_fit`; Triton 3.6.0 to 3.9.0 give the same bytes) and are stored in
`shared_memory.json`; sm_80, sm_86 and sm_89 compile to the same Triton GPU IR and share one column, sm_90 (wgmma)
has its own. A head-dim class is measured at its widest head dim (64, 128, 256), an upper bound for the narrower
ones. `tests/test_launch_fit.py` recompiles the configs and fails when the table is stale, when a returned config
exceeds a target's limit or spills more registers than its budget. On a GPU the launch code still catches "out of
resources" (a Triton version not measured may allocate differently) and moves to the next config.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import torch

__all__ = [
    "GPU_TARGETS",
    "KERNELS",
    "LaunchConfigError",
    "TileConfig",
    "candidate_configs",
    "has_measured_tiles",
    "launch_configs",
    "shared_memory_bytes",
    "spill_budget",
]

KERNELS = ("fwd", "dkdv", "dq")

# name -> (compute capability, opt-in shared memory per block in bytes): the GPUs users train on.
GPU_TARGETS: dict[str, tuple[tuple[int, int], int]] = {
    "A100 (sm_80)": ((8, 0), 166912),
    "RTX 3090 (sm_86)": ((8, 6), 101376),
    "RTX 4090 (sm_89)": ((8, 9), 101376),
    "H100/H200 (sm_90)": ((9, 0), 232448),
}


class LaunchConfigError(RuntimeError):
    """No candidate tile of a kernel fits the device (shared memory per block) for this dtype and head dim."""


@dataclass(frozen=True, order=True)
class TileConfig:
    """One launch configuration: query rows and key rows per tile, warps per program, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"

    def launch_kwargs(self) -> dict[str, int]:
        """The keyword arguments a kernel launch takes for this config."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


def _tiles(*shapes: tuple[int, int, int, int]) -> tuple[TileConfig, ...]:
    return tuple(TileConfig(*shape) for shape in shapes)


# (kernel, bytes per element, head-dim class) -> candidates, best first (the no-autotune path launches the first
# that fits). Chosen by compiling candidates for sm_86 and sm_90 (benchmarks/fit_report.py) under Triton 3.6.0 (the
# H200 check host's), 3.7.1 (what torch 2.13's CUDA wheels install), 3.8.0 (the newest for Python 3.10) and 3.9.0
# (CI's): every one fits sm_86's 99 KiB of shared memory (so all four targets; the bytes were the same under all four
# versions), and none spills more than `spill_budget` under any of them. The versions differ in registers, not in
# shared memory: older Triton emits other PTX for the same tile, and on it ptxas (12.8 to 13.4 alike) may stop at 64,
# 80 or 128 registers and spill a few bytes, so 14 tiles that 3.9 compiles without spills spilled 4 to 188 bytes under
# an older one. Those were replaced by the same tile with fewer stages or another warp count where that is spill-free
# under all four, else by a neighbouring shape. 4 warps suit only small tiles: 16-bit dK/dV tiles of 64 x 64 and up,
# and fp32 tiles of 32 rows and up at head dims 128 and 256, run out of registers with them (fp32 dots are FMA loops
# that keep operand fragments in registers). fp32 takes 8 or 16 warps (4 on one small dK/dV tile) and 16- or 32-row
# tiles: the accurate path, not the fast one. Three per list keep the CI fit check short; fp32 dK/dV at head dim 256
# has two, the only ones of the 22 tried within sm_86's shared memory that spill nothing under all four versions.
_CANDIDATES: dict[tuple[str, int, int], tuple[TileConfig, ...]] = {
    ("fwd", 2, 64): _tiles((128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)),
    ("fwd", 2, 128): _tiles((128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2)),
    ("fwd", 2, 256): _tiles((64, 32, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2)),
    ("fwd", 4, 64): _tiles((32, 32, 8, 2), (16, 64, 8, 1), (32, 16, 8, 1)),
    ("fwd", 4, 128): _tiles((32, 16, 8, 1), (16, 32, 8, 1), (16, 16, 8, 1)),
    ("fwd", 4, 256): _tiles((16, 32, 8, 2), (32, 16, 8, 1), (16, 16, 8, 1)),
    ("dkdv", 2, 64): _tiles((64, 64, 8, 1), (32, 128, 8, 2), (64, 128, 8, 1)),
    ("dkdv", 2, 128): _tiles((64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 8, 2)),
    ("dkdv", 2, 256): _tiles((32, 32, 8, 1), (16, 32, 8, 1), (32, 16, 4, 1)),
    ("dkdv", 4, 64): _tiles((16, 32, 8, 1), (32, 16, 4, 1), (16, 32, 8, 2)),
    ("dkdv", 4, 128): _tiles((16, 64, 8, 2), (16, 64, 16, 1), (16, 16, 8, 1)),
    ("dkdv", 4, 256): _tiles((16, 32, 16, 1), (16, 32, 16, 2)),
    ("dq", 2, 64): _tiles((128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3)),
    ("dq", 2, 128): _tiles((64, 64, 4, 1), (64, 32, 8, 2), (32, 128, 8, 1)),
    ("dq", 2, 256): _tiles((32, 64, 4, 1), (32, 32, 4, 1), (32, 64, 8, 1)),
    ("dq", 4, 64): _tiles((32, 32, 8, 2), (16, 64, 8, 1), (32, 32, 8, 1)),
    ("dq", 4, 128): _tiles((16, 64, 8, 1), (32, 16, 8, 1), (16, 32, 8, 1)),
    ("dq", 4, 256): _tiles((16, 32, 8, 1), (32, 16, 8, 1), (16, 16, 8, 1)),
}
_DTYPE_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def _element_bytes(dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    return _DTYPE_BYTES[dtype]


def head_dim_class(head_dim: int) -> int:
    """The candidate list a head dim uses: 64 (D <= 64), 128 (D <= 128) or 256 (D <= 256)."""
    if not isinstance(head_dim, int) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be an int in 16..256, got {head_dim!r}")
    return 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)


def candidate_configs(kernel: str, dtype: torch.dtype, head_dim: int) -> tuple[TileConfig, ...]:
    """Every tile `kernel` may try for `dtype` and `head_dim`, best first, before any device limit is applied.

    Example:
        >>> candidate_configs("fwd", torch.bfloat16, 128)[0]
        TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    """
    _check_kernel(kernel)
    return _CANDIDATES[(kernel, _element_bytes(dtype), head_dim_class(head_dim))]


def _family(capability: tuple[int, int]) -> str:
    """The shared-memory column of a compute capability: "sm80" (8.0 to 8.9, one Triton GPU IR) or "sm90"."""
    if (
        not isinstance(capability, tuple)
        or len(capability) != 2
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
    ):
        raise ValueError(f"capability must be a (major, minor) tuple of ints such as (8, 6), got {capability!r}")
    if capability[0] == 8:
        return "sm80"
    if capability == (9, 0):
        return "sm90"
    raise ValueError(
        f"capability {capability[0]}.{capability[1]} has no measured tiles (measured: 8.0-8.9 and 9.0); "
        "pass the nearest of those or run on backend='torch'"
    )


@functools.lru_cache(maxsize=1)
def _shared_table() -> dict[str, int]:
    text = resources.files("alibi_kernels").joinpath("shared_memory.json").read_text(encoding="utf-8")
    return json.loads(text)["shared_bytes"]


def table_key(kernel: str, config: TileConfig, element_bytes: int, d_class: int, family: str) -> str:
    """The row of `shared_memory.json` for one kernel: kernel, family, bytes per element, head-dim class, config."""
    c = config
    return f"{kernel} {family} e{element_bytes} d{d_class} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"


def shared_memory_bytes(
    kernel: str, config: TileConfig, *, capability: tuple[int, int], dtype: torch.dtype, head_dim: int
) -> int:
    """Shared memory per block that `config` of `kernel` needs on `capability`, as measured by an ahead-of-time compile.

    Example:
        >>> tile = candidate_configs("fwd", torch.bfloat16, 128)[0]
        >>> shared_memory_bytes("fwd", tile, capability=(8, 6), dtype=torch.bfloat16, head_dim=128) <= 101376
        True
    """
    _check_kernel(kernel)
    key = table_key(kernel, config, _element_bytes(dtype), head_dim_class(head_dim), _family(capability))
    table = _shared_table()
    if key not in table:
        raise ValueError(
            f"no measured shared memory for {key!r}: the config is not a candidate of this package version "
            "(candidate_configs lists them)"
        )
    return table[key]


def spill_budget(kernel: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] = (8, 6)) -> int:
    """Bytes of register spill stores a returned config may have when compiled for `capability` (the fit check
    enforces it).

    Zero for the forward everywhere, and for the backward kernels at head dims 64, 128 and 256 on sm_86, sm_89 and
    sm_90. 64 bytes for the backward at padded head dims (80, 96, ...: the masked loads of the padding cost
    registers) and on sm_80, whose ptxas allocates differently: the full fit grid measured up to 44 bytes there
    (under each of Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0).

    Example:
        >>> spill_budget("dkdv", torch.bfloat16, 128), spill_budget("dkdv", torch.bfloat16, 80)
        (0, 64)
    """
    candidate_configs(kernel, dtype, head_dim)  # validates the arguments
    _family(capability)
    padded = head_dim & (head_dim - 1) != 0
    if kernel == "fwd" or not (padded or capability == (8, 0)):
        return 0
    return 64


def has_measured_tiles(capability: tuple[int, int]) -> bool:
    """Whether `shared_memory.json` has a column for `capability` (8.0 to 8.9, and 9.0)."""
    try:
        _family(capability)
    except ValueError:
        return False
    return True


def launch_configs(
    kernel: str, *, capability: tuple[int, int], smem_per_block: int, dtype: torch.dtype, head_dim: int
) -> list[TileConfig]:
    """The candidate tiles of `kernel` that fit a device with `capability` and `smem_per_block` bytes, best first.

    `smem_per_block` is the opt-in maximum shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin): 166912
    on an A100, 101376 on an RTX 3090 or 4090, 232448 on an H100/H200 (`GPU_TARGETS`). An empty list means the
    kernel cannot run there for this dtype and head dim; every candidate of this version fits the four targets of
    `GPU_TARGETS`, which `tests/test_launch_fit.py` checks by compiling them.

    Example:
        >>> fp32 = launch_configs("dkdv", capability=(8, 6), smem_per_block=101376, dtype=torch.float32, head_dim=128)
        >>> len(fp32) > 0 and all(shared_memory_bytes("dkdv", c, capability=(8, 6), dtype=torch.float32,
        ...                                           head_dim=128) <= 101376 for c in fp32)
        True
    """
    if not isinstance(smem_per_block, int) or smem_per_block <= 0:
        raise ValueError(f"smem_per_block must be a positive int of bytes (101376 on sm_86), got {smem_per_block!r}")
    fitting = []
    for config in candidate_configs(kernel, dtype, head_dim):
        needed = shared_memory_bytes(kernel, config, capability=capability, dtype=dtype, head_dim=head_dim)
        if needed <= smem_per_block:
            fitting.append(config)
    return fitting
