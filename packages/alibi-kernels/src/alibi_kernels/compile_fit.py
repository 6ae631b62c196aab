"""Compile the Triton kernels for a CUDA target without a GPU and report what one launch needs.

`kernel_launches` runs this package's own launch code on small CPU tensors with the launches captured, so a compile
sees the arguments a real call passes: Triton's specialisations (strides of 1 become constants, pointers and
strides divisible by 16 are marked so), the compile-time constants and the dtypes. `compile_fit` then compiles one
launch with one tile config for a compute capability with Triton's frontend and its bundled ptxas, and returns the
shared memory per block, the registers per thread and the spill bytes that ptxas reports. With `ptxas=False` it
stops after the LLVM IR (shared memory is final there): about half the time, no registers or spills.

Results are cached as small JSON files (ALIBI_KERNELS_FIT_CACHE, default ~/.cache/alibi-kernels/fit) under Triton's
own cache key of the compile (Triton version, kernel source, specialisation, target, options), so a second run of
an unchanged kernel takes no compile. Needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from alibi_kernels.launch_configs import TileConfig

__all__ = ["KernelFit", "compile_fit", "kernel_launches", "fit_cache_dir"]

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class KernelFit:
    """What one compiled kernel needs per launch on one target."""

    shared_bytes: int  # shared memory per block (Triton's allocation)
    registers: int | None  # registers per thread (ptxas); None when compiled without ptxas
    spill_stores: int | None  # bytes of register spill stores (ptxas)
    spill_loads: int | None  # bytes of register spill loads (ptxas)
    stack_bytes: int | None  # stack frame bytes (ptxas)


def fit_cache_dir() -> Path:
    """Where compile results are cached: ALIBI_KERNELS_FIT_CACHE, else ~/.cache/alibi-kernels/fit."""
    return Path(os.environ.get("ALIBI_KERNELS_FIT_CACHE", Path.home() / ".cache" / "alibi-kernels" / "fit"))


def _require_compiled_mode() -> None:
    from alibi_kernels import attention_triton

    if attention_triton.INTERPRETED:
        raise RuntimeError(
            "compile checks need compiled kernels: unset TRITON_INTERPRET before alibi_kernels is imported "
            "(run them in a separate process)"
        )


def kernel_launches(
    dtype: torch.dtype, head_dim: int, *, causal: bool = True, varlen: bool = False, slope_grad: bool = False
) -> dict:
    """The three launches ("fwd", "dkdv", "dq") of one forward+backward call, captured on CPU tensors.

    The call is a typical training shape: B = 2, 4 query heads over 2 k/v heads, T = 256, contiguous (B, H, T, D)
    tensors (or packed documents of 100 and 156 tokens with `varlen`). Only the specialisation of the arguments
    matters to a compile, and every contiguous or (B, T, H, D)-transposed layout with D a multiple of 16 gives
    the same one.
    """
    _require_compiled_mode()
    from alibi_kernels.attention_triton import captured_launches, triton_call
    from alibi_kernels.validation import check_attention_inputs, check_varlen_inputs

    gen = torch.Generator().manual_seed(0)
    if varlen:
        q = torch.randn(256, 4, head_dim, generator=gen).to(dtype)  # (total, Hq, D)
        k, v = (torch.randn(256, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu, None, None, None)
        extra: tuple[Any, ...] = (cu, shape.max_seqlen)
    else:
        q = torch.randn(2, 4, 256, head_dim, generator=gen).to(dtype)  # (B, Hq, T, D)
        k, v = (torch.randn(2, 2, 256, head_dim, generator=gen).to(dtype) for _ in range(2))
        _, slopes_2d, scale = check_attention_inputs(q, k, v, None, causal, None)
        extra = ()
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    slopes_2d = slopes_2d.clone().requires_grad_(slope_grad)
    with captured_launches() as launches:
        out = triton_call(q, k, v, slopes_2d, causal, scale, *extra)
        out.backward(torch.zeros_like(out))
    return {launch.kernel: launch for launch in launches}


def _source_and_options(launch, config: TileConfig, capability: tuple[int, int]):
    """Triton's ASTSource, backend and parsed options for `launch` with `config`, bound as Triton's launcher binds
    arguments before it compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from alibi_kernels.attention_triton import RAW_KERNELS

    fn = RAW_KERNELS[launch.kernel]
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.constants, **config.launch_kwargs()}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), target, backend, options


class _StopAfterLLIR(Exception):
    def __init__(self, shared: int) -> None:
        super().__init__(shared)
        self.shared = shared


def _stop_after_llir_hook(backend=None, stages=None, options=None, language=None, capability=None):
    """knobs.runtime.add_stages_inspection_hook: without arguments the cache key part, else it cuts the pipeline."""
    if stages is None:
        return "alibi-kernels-stop-after-llir", "alibi-kernels-stop-after-llir"
    make_llir = stages["llir"]

    def llir_then_stop(src, metadata):
        make_llir(src, metadata)
        raise _StopAfterLLIR(metadata["shared"])

    stages["llir"] = llir_then_stop
    return None


def compile_fit(launch, config: TileConfig, capability: tuple[int, int], *, ptxas: bool = True) -> KernelFit:
    """Compile `launch` (from `kernel_launches`) with tile `config` for `capability` and report what it needs.

    Example (compiled mode only, so not run as a doctest here):
        >>> launches = kernel_launches(torch.bfloat16, 128)  # doctest: +SKIP
        >>> compile_fit(launches["dkdv"], TileConfig(64, 64, 4, 2), (8, 6))  # doctest: +SKIP
        KernelFit(shared_bytes=..., registers=..., spill_stores=0, spill_loads=0, stack_bytes=0)
    """
    import triton
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    _require_compiled_mode()
    src, target, backend, options = _source_and_options(launch, config, capability)
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars()) + ("-ptxas" if ptxas else "-llir")
    cache_file = fit_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    if cache_file.exists():
        return KernelFit(**json.loads(cache_file.read_text()))

    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log, knobs.runtime.add_stages_inspection_hook)
    log = io.StringIO()
    try:
        knobs.compilation.always_compile = True  # Triton's cache would skip ptxas, and with it the register report
        if ptxas:
            knobs.nvidia.dump_ptxas_log = True
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(src, target=target, options=options.__dict__)
            shared = compiled.metadata.shared
        else:
            knobs.runtime.add_stages_inspection_hook = _stop_after_llir_hook
            try:
                triton.compile(src, target=target, options=options.__dict__)
                raise AssertionError("the compile did not stop after the LLVM IR")
            except _StopAfterLLIR as stop:
                shared = stop.shared
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved[0], saved[1]
        knobs.runtime.add_stages_inspection_hook = saved[2]

    registers = spill_stores = spill_loads = stack = None
    if ptxas:
        text = log.getvalue()
        used, spills = _PTXAS_USED.search(text), _PTXAS_SPILLS.search(text)
        if used is None or spills is None:
            raise RuntimeError(f"could not read registers and spills from ptxas -v output:\n{text}")
        registers = int(used.group(1))
        stack, spill_stores, spill_loads = (int(g) for g in spills.groups())
    fit = KernelFit(shared, registers, spill_stores, spill_loads, stack)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cache_file.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(asdict(fit), tmp)
    os.replace(tmp.name, cache_file)  # atomic: parallel workers never read half a file
    return fit


# ---------------------------------------------------------------- the fit check over a grid of launches
@dataclass(frozen=True)
class FitGrid:
    """Which launches a fit check compiles: dtypes x head dims x kernels x every config `launch_configs` returns for
    each target. `compiled_as` maps a target to the capability its rows are compiled for (sm_80 and sm_89 share
    sm_86's Triton GPU IR, so their shared memory may come from one compile); `ptxas` says whether registers and
    spills are checked there."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    compiled_as: dict  # target name -> (capability compiled for, with ptxas)


_SM86, _SM90 = (8, 6), (9, 0)
FIT_GRIDS = {
    # CI: bf16 and fp32 (fp16 compiles to the same shared memory as bf16), head dims 64, 128, 256; shared memory of
    # every returned config for all four targets from sm_86 and sm_90 compiles, registers and spills on sm_86 and
    # sm_90 (the targets of the reference cluster and of the GPU check host).
    "ci": FitGrid(
        "ci",
        (torch.bfloat16, torch.float32),
        (64, 128, 256),
        {
            "A100 (sm_80)": (_SM86, True),
            "RTX 3090 (sm_86)": (_SM86, True),
            "RTX 4090 (sm_89)": (_SM86, True),
            "H100/H200 (sm_90)": (_SM90, True),
        },
    ),
    # Everything: each dtype, head dims 64, 80 (padded to 128), 128, 256, each target compiled for itself.
    "full": FitGrid(
        "full",
        (torch.float16, torch.bfloat16, torch.float32),
        (64, 80, 128, 256),
        {
            "A100 (sm_80)": ((8, 0), True),
            "RTX 3090 (sm_86)": (_SM86, True),
            "RTX 4090 (sm_89)": ((8, 9), True),
            "H100/H200 (sm_90)": (_SM90, True),
        },
    ),
}


@dataclass(frozen=True)
class FitRow:
    """One compiled config on one target, with the verdict of the fit check."""

    kernel: str
    dtype: torch.dtype
    head_dim: int
    config: TileConfig
    target: str
    compiled_as: tuple[int, int]
    smem_limit: int
    table_bytes: int  # what `shared_memory.json` says (what launch_configs decided with)
    fit: KernelFit
    spill_budget: int

    def problems(self) -> list[str]:
        """Why this row fails the check: over the shared-memory limit, a stale table entry, spills over budget."""
        out = []
        if self.fit.shared_bytes > self.smem_limit:
            out.append(f"needs {self.fit.shared_bytes} B of shared memory, {self.target} has {self.smem_limit}")
        if self.fit.shared_bytes > self.table_bytes:
            out.append(
                f"compiles to {self.fit.shared_bytes} B but shared_memory.json says {self.table_bytes}: regenerate it "
                "(python packages/alibi-kernels/benchmarks/fit_report.py --write-table)"
            )
        if self.fit.spill_stores is not None and self.fit.spill_stores > self.spill_budget:
            out.append(f"spills {self.fit.spill_stores} B of registers, budget {self.spill_budget}")
        return out


def _compile_job(job: tuple) -> KernelFit:
    kernel, dtype, head_dim, config, capability, ptxas = job
    return compile_fit(_launches(dtype, head_dim)[kernel], config, capability, ptxas=ptxas)


_launch_cache: dict = {}


def _launches(dtype: torch.dtype, head_dim: int) -> dict:
    if (dtype, head_dim) not in _launch_cache:
        _launch_cache[(dtype, head_dim)] = kernel_launches(dtype, head_dim)
    return _launch_cache[(dtype, head_dim)]


def fit_rows(grid: FitGrid, workers: int = 1) -> list[FitRow]:
    """Compile every launch of `grid` (in `workers` processes) and return one row per (target, returned config)."""
    from alibi_kernels.launch_configs import GPU_TARGETS, KERNELS, launch_configs, shared_memory_bytes, spill_budget

    planned = []
    for dtype in grid.dtypes:
        for head_dim in grid.head_dims:
            for kernel in KERNELS:
                for target, (capability, smem) in GPU_TARGETS.items():
                    compiled_as, ptxas = grid.compiled_as[target]
                    kwargs: dict[str, Any] = {"capability": capability, "dtype": dtype, "head_dim": head_dim}
                    for config in launch_configs(kernel, smem_per_block=smem, **kwargs):
                        table = shared_memory_bytes(kernel, config, **kwargs)
                        job = (kernel, dtype, head_dim, config, compiled_as, ptxas)
                        budget = spill_budget(kernel, dtype, head_dim, compiled_as)
                        planned.append((job, target, smem, table, budget))
    jobs = list(dict.fromkeys(job for job, *_ in planned))
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            fits = dict(zip(jobs, pool.map(_compile_job, jobs), strict=True))
    else:
        fits = {job: _compile_job(job) for job in jobs}
    return [
        FitRow(job[0], job[1], job[2], job[3], target, job[4], smem, table, fits[job], budget)
        for job, target, smem, table, budget in planned
    ]
