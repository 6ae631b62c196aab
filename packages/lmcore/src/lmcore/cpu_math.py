"""CPU math for a training step: fp32 GEMMs on oneDNN where a probe measures them faster and still fp32, and
whether the CPU computes bf16 natively.

torch sends fp32 GEMMs to MKL. The one torch 2.13 setting that sends them to oneDNN instead is
`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, which also lets oneDNN round the inputs to bf16 where it
has a bf16 kernel for them: with AMX it does (brg_matmul:avx10_1_512_amx, relative errors near 3e-3 against
float64), with AVX512_BF16 alone it keeps fp32 kernels (brg_matmul:avx512_core), which at the small widths of a
CPU model can beat MKL or not, by CPU. So the choice is measured per machine at the model's own shapes: the probe
times MKL against oneDNN, compares both with float64, and routes only what is faster and as exact as fp32. SDPA
keeps MKL either way (alibi-kernels' torch path sets "ieee" around it, forward and backward): its flash kernel's
many small GEMMs are several times slower through oneDNN.

Example:
    >>> import torch
    >>> from lmcore import ModelConfig
    >>> probe = route_cpu_matmuls(ModelConfig.from_preset("tiny"), tokens=64, enabled=False)
    >>> probe.routed, probe.reason, cpu_matmul_library()
    (False, 'disabled by the caller', 'mkl')
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from lmcore.config import ModelConfig

__all__ = [
    "FP32_ERROR_FLOOR",
    "MIN_SPEEDUP",
    "GemmShape",
    "MatmulProbe",
    "cpu_has_native_bf16",
    "cpu_matmul_library",
    "model_gemm_shapes",
    "probe_matmul_routing",
    "route_cpu_matmuls",
    "set_cpu_matmul_library",
]

# The fp32_precision value that sends fp32 GEMMs to oneDNN (and lets it use bf16 products where it has AMX).
_ROUTED = "bf16"
# oneDNN's results count as fp32 when their error against float64 is at most twice MKL's plus this floor: an fp32
# kernel's error is of MKL's size (a few 1e-7 relative at K = 128), a bf16 product's about 1e4 times that.
FP32_ERROR_FLOOR = 1e-6
# oneDNN is chosen only when it makes the model's GEMMs at least this much faster (the probe's noise is smaller).
MIN_SPEEDUP = 1.05
# Under other processes' load a probe's CPU second can take several wall seconds: it stops at this many too.
_WALL_PER_CPU_SECOND = 4.0
# x86 feature flags (Linux /proc/cpuinfo names) of a CPU that multiplies bf16 in hardware.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class _Fp32Precision(Protocol):
    fp32_precision: str


def _matmul() -> _Fp32Precision:
    """torch.backends.mkldnn.matmul, where fp32 GEMMs are routed."""
    # torch replaces the torch.backends.mkldnn module by an object at import; its stubs do not declare `matmul`.
    return torch.backends.mkldnn.matmul  # type: ignore[attr-defined]


def cpu_has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU multiplies bf16 in hardware: AVX512_BF16 or AMX-BF16 (x86).

    `flags`: CPU feature flags to judge, /proc/cpuinfo spelling (e.g. `{"avx512f", "avx512_bf16"}`); None asks
    torch's CPU feature detection (any OS), then /proc/cpuinfo where it exists. Other architectures answer False:
    nothing here measured them.

    What a planner's rule can cite (docs/benchmarks.md, "A training step at the machine's limit"): on a 2-core
    Xeon with AVX512_BF16 and AMX, cpu-small trained 600 steps on TinyShakespeare (seeds 0, 1, 2) reached
    2.3518, 2.3448, 2.3546 bits/char in fp32 and 2.3561, 2.3405, 2.3489 with bf16 autocast: bf16 minus fp32
    +0.004, -0.004, -0.006, inside the 0.010 spread between seeds. A bf16 step there took 0.66-0.67x the CPU time
    of an fp32 one (one thread); with AMX masked (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, AVX512_BF16 kernels only)
    it took 1.28-1.32x, slower. So the flag says bf16 is native, not that it is faster: time a step of each.

    Example:
        >>> cpu_has_native_bf16({"avx512f", "avx512_bf16"}), cpu_has_native_bf16({"avx512f", "avx2"})
        (True, False)
    """
    if flags is not None:
        if isinstance(flags, str):
            raise TypeError("flags must be a collection of flag names, not one string (split it first)")
        return any(f.lower() in _BF16_FLAGS for f in flags)
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    detect = [d for d in (getattr(torch.cpu, name, None) for name in names) if callable(d)]
    if len(detect) == len(names):
        return any(d() for d in detect)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return False
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return cpu_has_native_bf16(line.partition(":")[2].split())
    return False


def onednn_takes_fp32_gemms() -> bool:
    """Whether routing fp32 GEMMs to oneDNN can change anything here: torch sends them there (bf16 fpmath) only on
    an x86 CPU with AVX-512 (F, BW, VL and DQ; its `mkldnn_bf16_device_check`), else keeps MKL whatever the setting
    says (seen on an AVX2-only AMD EPYC: oneDNN's verbose log stayed empty). True where torch cannot tell.
    """
    detect = getattr(torch.cpu, "_is_avx512_supported", None)
    return bool(detect()) if callable(detect) else True


def cpu_matmul_library() -> str:
    """Where fp32 GEMMs go now: "onednn" (routed) or "mkl" (torch's default).

    Example:
        >>> cpu_matmul_library()
        'mkl'
    """
    return "mkl" if _matmul().fp32_precision in ("none", "ieee") else "onednn"


def set_cpu_matmul_library(library: str) -> None:
    """Send fp32 GEMMs to "onednn" or back to "mkl", unchecked: `route_cpu_matmuls` decides by measuring.

    Example:
        >>> set_cpu_matmul_library("mkl"); cpu_matmul_library()
        'mkl'
    """
    if library not in ("onednn", "mkl"):
        raise ValueError(f"library must be 'onednn' or 'mkl', got {library!r}")
    _matmul().fp32_precision = _ROUTED if library == "onednn" else "none"


class GemmShape(NamedTuple):
    """One linear layer's forward GEMM: (rows, in_features) @ (in_features, out_features), run `count` times a step."""

    rows: int
    in_features: int
    out_features: int
    count: int = 1  # type: ignore[assignment]  # the field shadows tuple.count, which a GemmShape has no use for

    @property
    def flops(self) -> int:
        """Forward and backward (input and weight gradients): three GEMMs of 2*M*K*N each, times `count`."""
        return 6 * self.rows * self.in_features * self.out_features * self.count


def model_gemm_shapes(config: ModelConfig, tokens: int) -> tuple[GemmShape, ...]:
    """The distinct linear-layer GEMMs of one step of `config` on `tokens` rows (micro batch x sequence length).

    Attention's own products are left out (SDPA keeps MKL).

    Example (in "tiny", q, k, v and o of both layers share one shape):
        >>> [tuple(s) for s in model_gemm_shapes(ModelConfig.from_preset("tiny"), 64)]
        [(64, 64, 64, 8), (64, 64, 256, 2), (64, 256, 64, 2), (64, 64, 97, 1)]
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int (micro batch x sequence length), got {tokens!r}")
    assert config.n_kv_head is not None and config.d_ff is not None  # __post_init__ replaces None by the default
    d, kv, ff, n = config.d_model, config.n_kv_head * config.head_dim, config.d_ff, config.n_layer
    counts: dict[tuple[int, int], int] = {}
    n_in = 2 if config.activation == "swiglu" else 1
    for k_n, c in (((d, d), 2), ((d, kv), 2), ((d, ff), n_in), ((ff, d), 1)):  # q/o, k/v, up (+gate), down
        counts[k_n] = counts.get(k_n, 0) + c * n
    counts[(d, config.vocab_size)] = counts.get((d, config.vocab_size), 0) + 1  # the output head
    return tuple(GemmShape(tokens, k, n_out, c) for (k, n_out), c in counts.items())


@dataclass(frozen=True)
class MatmulProbe:
    """What `probe_matmul_routing` measured and decided.

    `routed`: oneDNN chosen. GFLOP/s are forward+backward of the model's linear layers in process CPU time (medians
    over alternated rounds); errors are the largest max|x - ref| / max|ref| against float64 over the outputs and
    both gradients of every shape. `kernels`: oneDNN's implementation names (its verbose log) when recorded.
    """

    routed: bool
    reason: str
    mkl_gflops: float = float("nan")
    onednn_gflops: float = float("nan")
    mkl_error: float = float("nan")
    onednn_error: float = float("nan")
    kernels: tuple[str, ...] = ()
    probe_s: float = 0.0  # process CPU seconds the probe took, the float64 checks included
    wall_s: float = 0.0

    @property
    def speedup(self) -> float:
        """oneDNN's GFLOP/s over MKL's at these shapes."""
        return self.onednn_gflops / self.mkl_gflops


@contextlib.contextmanager
def _library(library: str) -> Iterator[None]:
    saved = _matmul().fp32_precision
    set_cpu_matmul_library(library)
    try:
        yield
    finally:
        _matmul().fp32_precision = saved


def _rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _linear_step(shape: GemmShape, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, input gradient and weight gradient of F.linear at `shape`, on seeded inputs in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.rows, shape.in_features, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(shape.out_features, shape.in_features, generator=g) * shape.in_features**-0.5).to(dtype)
    w.requires_grad_()
    grad_out = torch.randn(shape.rows, shape.out_features, generator=g).to(dtype)
    y = F.linear(x, w)
    y.backward(grad_out)
    assert x.grad is not None and w.grad is not None  # both are leaves that require grad
    return y.detach(), x.grad, w.grad


@contextlib.contextmanager
def _onednn_log() -> Iterator[list[str]]:
    """oneDNN's verbose lines written inside the block (it prints to file descriptor 1), as a list filled on exit."""
    lines: list[str] = []
    sys.stdout.flush()
    saved_fd = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                yield lines
        finally:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            log.seek(0)
            lines.extend(log.read().decode(errors="replace").splitlines())


def _kernel_names(lines: list[str]) -> tuple[str, ...]:
    """`brg_matmul:avx512_core (fpmath bf16)`-style names of the matmul primitives oneDNN ran."""
    names = []
    for line in lines:
        fields = line.split(",")
        if len(fields) > 9 and fields[2] == "primitive" and fields[3] == "exec" and fields[5] == "matmul":
            fpmath = [a.split(":", 1)[1] for a in fields[9].split() if a.startswith("attr-fpmath:")]
            names.append(fields[6] + (f" (fpmath {fpmath[0]})" if fpmath else ""))
    return tuple(sorted(set(names)))


def probe_matmul_routing(
    shapes: Sequence[GemmShape], *, max_seconds: float = 1.0, record_kernels: bool = False
) -> MatmulProbe:
    """Measure whether oneDNN runs `shapes` (forward and backward) faster than MKL and as exactly; change nothing.

    Rounds alternate the two libraries (who goes first alternates too) until `max_seconds` of process CPU time (or
    4 x that of wall time) are spent, at least 3 rounds and at most 20, at the current `torch.get_num_threads()`;
    one warm-up round comes first (oneDNN builds its kernels then). oneDNN is chosen when its error against float64
    is at most 2 x MKL's + FP32_ERROR_FLOOR and its median speed at least MIN_SPEEDUP x MKL's. `record_kernels`
    captures oneDNN's verbose log (it writes to file descriptor 1, redirected for a moment) for the kernel names.

    Example:
        >>> probe = probe_matmul_routing([GemmShape(64, 64, 64)], max_seconds=0.05)
        >>> probe.routed == probe.reason.startswith("oneDNN")  # an AVX2-only CPU: "MKL: ... AVX-512 ..." unmeasured
        True
    """
    shapes = tuple(shapes)
    if not shapes or not all(isinstance(s, GemmShape) for s in shapes):
        raise ValueError(f"shapes must be a non-empty sequence of GemmShape, got {shapes!r}")
    if not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0, got {max_seconds!r}")
    if not torch.backends.mkldnn.is_available():
        return MatmulProbe(False, "this torch build has no oneDNN (mkldnn)")
    if not onednn_takes_fp32_gemms():
        return MatmulProbe(False, "MKL: torch sends fp32 GEMMs to oneDNN only on a CPU with AVX-512, which this lacks")
    start, wall_start = time.process_time(), time.perf_counter()
    errors = {}
    kernels: tuple[str, ...] = ()
    for library in ("mkl", "onednn"):
        with _library(library):
            worst = 0.0
            for i, shape in enumerate(shapes):
                one = GemmShape(min(shape.rows, 4096), shape.in_features, shape.out_features)
                refs = _linear_step(one, torch.float64, seed=i)
                if library == "onednn" and record_kernels:
                    with _onednn_log() as lines:
                        got = _linear_step(one, torch.float32, seed=i)
                    kernels = tuple(sorted(set(kernels) | set(_kernel_names(lines))))
                else:
                    got = _linear_step(one, torch.float32, seed=i)
                worst = max(worst, *(_rel_error(a, r) for a, r in zip(got, refs, strict=True)))
            errors[library] = worst
    flops = sum(s.flops for s in shapes)
    inputs = [_inputs(s) for s in shapes]
    seconds: dict[str, list[float]] = {"mkl": [], "onednn": []}
    for round_ in range(21):
        order = ("mkl", "onednn") if round_ % 2 == 0 else ("onednn", "mkl")
        for library in order:
            with _library(library):
                total = 0.0
                for shape, (x, w, grad_out) in zip(shapes, inputs, strict=True):
                    t0 = time.process_time()
                    torch.autograd.grad(F.linear(x, w), (x, w), grad_out)
                    total += shape.count * (time.process_time() - t0)  # run once, counted as often as a step runs it
                if round_ > 0:
                    seconds[library].append(total)
        spent = time.process_time() - start, time.perf_counter() - wall_start
        if round_ >= 3 and (spent[0] > max_seconds or spent[1] > _WALL_PER_CPU_SECOND * max_seconds):
            break
    mkl = flops / statistics.median(seconds["mkl"]) / 1e9
    onednn = flops / statistics.median(seconds["onednn"]) / 1e9
    routed, reason = _decision(mkl, onednn, errors["mkl"], errors["onednn"])
    spent = time.process_time() - start, time.perf_counter() - wall_start
    return MatmulProbe(routed, reason, mkl, onednn, errors["mkl"], errors["onednn"], kernels, *spent)


def _decision(mkl_gflops: float, onednn_gflops: float, mkl_error: float, onednn_error: float) -> tuple[bool, str]:
    """The rule: oneDNN when its results are fp32's (error at most 2 x MKL's + FP32_ERROR_FLOOR) and it is at least
    MIN_SPEEDUP x faster; (routed, the reason in one line)."""
    if not onednn_error <= 2 * mkl_error + FP32_ERROR_FLOOR:
        return False, (
            f"MKL: oneDNN's error {onednn_error:.1e} against float64 is not fp32's ({mkl_error:.1e} for MKL): "
            "it rounds to bf16 on this CPU"
        )
    if not onednn_gflops >= MIN_SPEEDUP * mkl_gflops:
        speeds = f"{onednn_gflops:.0f} vs {mkl_gflops:.0f} GFLOP/s"
        return False, f"MKL: oneDNN is not faster here ({speeds} at the model's shapes)"
    return True, f"oneDNN: {onednn_gflops / mkl_gflops:.2f}x MKL's speed at the model's shapes, with fp32's errors"


def _inputs(shape: GemmShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(shape.rows + shape.in_features + shape.out_features)
    x = torch.randn(shape.rows, shape.in_features, generator=g).requires_grad_()
    w = (torch.randn(shape.out_features, shape.in_features, generator=g) * 0.02).requires_grad_()
    return x, w, torch.randn(shape.rows, shape.out_features, generator=g)


def route_cpu_matmuls(
    config: ModelConfig, tokens: int, *, enabled: bool = True, max_seconds: float = 1.0
) -> MatmulProbe:
    """Probe oneDNN against MKL at `config`'s GEMMs on `tokens` rows and route fp32 GEMMs to the one it picks.

    Call it once the thread count is set (the answer can differ by thread count) and before training. `enabled=False`
    is the off switch: fp32 GEMMs go to MKL, nothing is measured. On a machine without oneDNN, or where the probe
    finds oneDNN slower or not fp32, GEMMs go to MKL too; `MatmulProbe.reason` says which.

    Example:
        >>> route_cpu_matmuls(ModelConfig.from_preset("tiny"), 64, enabled=False).reason
        'disabled by the caller'
    """
    shapes = model_gemm_shapes(config, tokens)
    if not enabled:
        set_cpu_matmul_library("mkl")
        return MatmulProbe(False, "disabled by the caller")
    probe = probe_matmul_routing(shapes, max_seconds=max_seconds)
    set_cpu_matmul_library("onednn" if probe.routed else "mkl")
    return probe
