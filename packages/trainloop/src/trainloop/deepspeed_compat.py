"""Every use of DeepSpeed's internals, in one place, checked against the releases it was written for.

The DeepSpeed engine uses DeepSpeed's public API where there is one (``initialize``, ``save_checkpoint``,
``load_checkpoint``, ``safe_get_full_grad``, ``safe_get_full_fp32_param``, ``safe_get/set_local_grad``); what it
needs beyond that is here:

- the gradient fragment a ZeRO-1/2 rank owns (``param._hp_mapping``), for per-group clipping without a gather;
- skipping a non-finite step through the ZeRO-1/2 optimizer's own overflow path (its ``check_grad_overflow``,
  ``check_overflow`` and ``overflow``), so that gradients are dropped and the optimizer state is untouched;
- loading a universal checkpoint into an engine built without that setting (``engine._config``), and converting
  a checkpoint to one (``deepspeed.checkpoint.ds_to_universal.main``'s arguments), with two repairs to ZeRO-3's
  universal loader (:func:`loading_universal`);
- ZeRO-3 with the optimizer on NVMe: the clipped gradients handed to the step (:class:`SwappedGradients`) and the
  optimizer state restored after a load (:func:`restore_swapped_optimizer`);
- ZeRO-3 keeping the model's dtype where the accelerator has no fp16 (:func:`keeping_model_dtype`);
- loading DeepSpeed's own checkpoint files without unpickling arbitrary objects: its default checkpoint engine
  calls ``torch.load(weights_only=False)``, which runs whatever a file's pickle names; :func:`safe_load` reads with
  ``weights_only=True`` and only the DeepSpeed classes its states hold (:func:`allowed_globals`), and
  :func:`load_safely` makes the engine use it.

:data:`TESTED` lists the releases the tests ran on (``nox -s deepspeed_lower_bound`` tests the oldest, CI the
newest); :func:`check_version` refuses a release outside the range the package's ``deepspeed`` extra admits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from trainloop.checkpoint import CheckpointError
from trainloop.config import ConfigError
from trainloop.extras import install_hint

# The releases this module was tested against: the lowest and the highest the `deepspeed` extra admits.
TESTED = ("0.18.0", "0.19.8")
SUPPORTED = ((0, 18, 0), (0, 20, 0))  # [lowest, first unsupported)


def _release(version: str) -> tuple[int, int, int]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def check_version(version: str) -> None:
    """Raise ``ConfigError`` in one line for a DeepSpeed release outside :data:`SUPPORTED`.

    Example:
        >>> check_version("0.19.8")
        >>> check_version("0.16.0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        trainloop.config.ConfigError: DeepSpeed 0.16.0 is not supported: trainloop's DeepSpeed engine needs >=0.18.0,...
    """
    low, high = SUPPORTED
    if not low <= _release(version) < high:
        span = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise ConfigError(
            f"DeepSpeed {version} is not supported: trainloop's DeepSpeed engine needs {span} (tested: "
            f"{', '.join(TESTED)}); {install_hint('deepspeed')} installs one"
        )


def local_fragment(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the reduced gradient of a ZeRO-1/2 parameter (a view: scaling it scales the grad), or
    None for a parameter without a ZeRO mapping."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    frag = mapping.get_lp_grad_fragment(param._index_in_param_group)  # type: ignore[attr-defined]
    addr = mapping.lp_fragment_address
    flat = frag.view(-1)
    # The bf16 optimizer keeps a full-size accumulation buffer; only the owned slice counts (as in DeepSpeed's own
    # get_full_hp_grad), otherwise every rank would add the whole gradient.
    if flat.numel() == param.numel() and addr.numel != param.numel():
        flat = flat.narrow(0, addr.start, addr.numel)
    return flat


def has_zero_mapping(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "_hp_mapping")


def skip_zero12_step(engine: Any, optimizer: Any) -> None:
    """Take a ZeRO-1/2 boundary step as an overflow: DeepSpeed drops the gradients and leaves the optimizer state
    (and, in bf16/fp32, the loss scale) as it was. The overflow flag is cleared afterwards: releases before 0.19.8
    cleared it only in their fp16 path, so every later bf16/fp32 step would have been skipped too."""
    saved = optimizer.check_grad_overflow
    optimizer.check_grad_overflow = True
    optimizer.check_overflow = lambda partition_gradients=True: setattr(optimizer, "overflow", True)
    try:
        engine.step()
    finally:
        del optimizer.check_overflow
        optimizer.check_grad_overflow = saved
        optimizer.overflow = False


def skip_zero3_step(engine: Any, params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """ZeRO-3 treats a non-finite gradient norm as an overflow and skips: hand it NaN gradients."""
    from deepspeed.utils import safe_set_local_grad

    for _, p in params:
        safe_set_local_grad(p, torch.full_like(p.ds_tensor, float("nan"), dtype=torch.float32))  # type: ignore[attr-defined]
    engine.step()


def swaps_optimizer(zero_optimizer: Any) -> bool:
    """Whether a ZeRO-3 optimizer keeps its states on NVMe (``offload_optimizer.device`` nvme)."""
    return bool(getattr(zero_optimizer, "swap_optimizer", False))


class SwappedGradients:
    """The loop's clipped local gradients handed to a ZeRO-3 step whose optimizer states live on NVMe.

    There ``safe_get_local_grad`` returns a view of a swap buffer that the next swap-in refills, and
    ``safe_set_local_grad``'s write-back does not reach the step, which swaps in the gradients as the backward wrote
    them (0.19.8: the run's losses were those of a run without clipping). The engine clips copies; each
    sub-group's fp32 gradient is overwritten with the clipped values after DeepSpeed swaps it in and before it
    unscales (its ``unscale_and_clip_grads``, wrapped on this optimizer only); :meth:`put` sets the values of the
    coming step."""

    def __init__(self, zero_optimizer: Any) -> None:
        self.zero = zero_optimizer
        self.pending: dict[int, torch.Tensor] = {}  # DeepSpeed's parameter id -> clipped local gradient
        original = zero_optimizer.unscale_and_clip_grads

        def unscale_and_clip_grads(sub_group_id: int, total_norm: Any) -> Any:
            grad = self.zero.fp32_partitioned_groups_flat[sub_group_id].grad
            for param_id, value in self.pending.items():
                group, offset, numel = self.zero.grad_position[param_id]
                if group == sub_group_id:
                    grad.narrow(0, offset, numel).copy_(value.flatten())
            return original(sub_group_id, total_norm)

        zero_optimizer.unscale_and_clip_grads = unscale_and_clip_grads

    def put(self, grads: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.pending = {self.zero.get_param_id(p): g for p, g in grads}


def restore_swapped_optimizer(zero_optimizer: Any, optim_states: Path) -> None:
    """After ``load_checkpoint`` with the optimizer states on NVMe, put back what DeepSpeed's loader leaves out.

    0.19.8's loader copies the swap files saved with the checkpoint into the swap folder and stops there. A fresh
    engine holds no optimizer state yet, so nothing reads those files: every swapped sub-group restarted AdamW
    (moments zero, step 0), and a sub-group too small to swap (under 1 MiB on a rank, such as the no-decay group of
    norms and biases) also kept the fresh engine's weights. Both are restored here: a swapped sub-group's moments
    from its swap files, through DeepSpeed's own swap-out; a resident one's fp32 partition and states, like its
    step count, from this rank's ``optim_states`` file (read without unpickling code), and each parameter's
    partition refreshed from them."""
    saved = safe_load(optim_states, map_location="cpu")["optimizer_state_dict"]  # the ZeRO-3 optimizer's own
    flats, states = saved["fp32_flat_groups"], saved["optimizer_state_dict"]["state"]
    zero = zero_optimizer
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        if zero._swappable_optimizer_subgroup(i):  # its partition lives in the swap folder (numel 0 here)
            numel = zero.fp16_partitioned_groups_flat_numel[i]
            zero._optimizer_states_and_gradient_swap_in(i)  # the fp32 partition, from the copied swap file
            folder = Path(zero.optimizer_swapper.swap_folder)
            state: dict[str, Any] = {"step": states[i]["step"].clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                swap = folder / f"{key}-{flat.ds_id}.tensor.swp"
                state[key] = torch.from_file(str(swap), size=numel, dtype=flat.dtype).clone()
            zero.optimizer.state[flat] = state
            zero._optimizer_states_and_gradient_swap_out(i)
            continue
        if flat.numel() == 0:
            continue
        flat.data.copy_(flats[i])
        zero.optimizer.state[flat] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states[i].items()}
        for param in zero.fp16_groups[i]:  # each parameter's partition, at its place in the flat group
            _, offset, numel = zero.grad_position[zero.get_param_id(param)]
            param.ds_tensor.data.copy_(flat.data.narrow(0, offset, numel))
    # Parameters under the persistence threshold stay whole on every rank: gather them again from their partitions
    # (a collective, as in DeepSpeed's own loader).
    persistent = list(getattr(zero, "persistent_parameters", []))
    if persistent:
        persistent[0].partition(persistent)
        persistent[0].all_gather(persistent)


@contextlib.contextmanager
def keeping_model_dtype():
    """Within the block (``deepspeed.initialize``), ZeRO-3's ``Init`` keeps the dtype it is given.

    DeepSpeed 0.19.8's ``_set_dtype`` computes it as ``dtype or torch.float16 if fp16 else torch.bfloat16 if ...``,
    which Python reads as ``(dtype or float16) if fp16 else (bfloat16 ...)``: on an accelerator without fp16 (a CPU
    whose oneDNN has no fp16, e.g. an AVX2-only AMD EPYC) the model's fp32, which the engine passes, becomes bf16.
    With parameters offloaded to NVMe the swap buffers then hold bf16 and the forward fails ("expected m1 and m2 to
    have the same dtype", ``tests/test_zero3.py``); on a CUDA device, which has fp16, nothing changes."""
    from deepspeed.runtime.zero import partition_parameters

    owner = partition_parameters.InsertPostInitMethodToModuleSubClasses
    original = getattr(owner, "_set_dtype", None)
    if original is None:  # a release without the method: nothing to repair
        yield
        return

    def set_dtype(self: Any, ds_config: Any, dtype: Any) -> None:
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    owner._set_dtype = set_dtype
    try:
        yield
    finally:
        owner._set_dtype = original


@contextlib.contextmanager
def loading_universal(engine: Any):
    """Within the block, ``engine.load_checkpoint`` reads DeepSpeed's universal format (a setting DeepSpeed
    otherwise takes only at initialisation).

    Two repairs after ZeRO-3's universal loader (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, 0.19.8;
    ZeRO-1/2's loader goes group by group and needs neither), without which a resume on another number of ranks
    drifted from the uninterrupted run (1e-3 relative three steps later, ``tests/test_zero3.py``):

    - it copies the first saved group's hyperparameters into every group, which gave the loop's no-decay group
      (norms, biases) weight decay: the run's values are put back;
    - it hands every partition one and the same ``step`` tensor, which the fused AdamW advances in place once per
      ZeRO-3 sub-group, so the second group's bias correction ran a step ahead: each gets its own copy."""
    zero = getattr(engine, "optimizer", None)
    groups = getattr(zero, "param_groups", None) or []
    saved = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
        for group, values in zip(groups, saved, strict=True):
            group.update(values)
        base = getattr(zero, "optimizer", None)
        for state in getattr(base, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def to_universal(tag_dir: Path, out_tag_dir: Path) -> None:
    """Convert one ZeRO-1/2/3 checkpoint tag into DeepSpeed's universal checkpoint (any world size loads it)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    if out_tag_dir.exists():
        shutil.rmtree(out_tag_dir)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(out_tag_dir),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines would interleave with the run's log
        ds_to_universal(args)


def allowed_globals() -> list[Any]:
    """The classes DeepSpeed's checkpoint files hold besides tensors and containers, which ``weights_only`` loading
    must be allowed to build. Measured on CPU with 0.19.8: ZeRO 0-3, bf16, fp32 and optimizer offload checkpoints
    need LossScaler, ZeroStageEnum and fragment_address; DynamicLossScaler is fp16's (DeepSpeed has no fp16 on CPU,
    so read from its source, not measured)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location: Any = None) -> Any:
    """A DeepSpeed checkpoint file read without running code: tensors, containers, numbers, strings and the classes
    of :func:`allowed_globals` only. Anything else is one ``CheckpointError`` naming the file and what it holds."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = " ".join(str(exc).split())
        named = detail.split("GLOBAL ", 1)[1].split(" ", 1)[0] if "GLOBAL " in detail else "an object"
        raise CheckpointError(
            f"{path}: refused: it holds {named}, which is not a DeepSpeed state class (a pickle that would run "
            "code when loaded); this checkpoint was not written by DeepSpeed as trainloop runs it: restore it from "
            "a copy you trust, or resume from another"
        ) from None


def load_safely(engine: Any) -> None:
    """Make ``engine`` (``deepspeed.initialize``'s) read its checkpoint files with :func:`safe_load`. Only DeepSpeed's
    default engine is replaced; another (Nebula, asynchronous writers) is refused, since what it reads is unknown."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if current is None or type(current) is not TorchCheckpointEngine:
        raise ConfigError(
            f"DeepSpeed checkpoint engine {type(current).__name__}: trainloop loads checkpoints only through "
            "DeepSpeed's default engine, read without unpickling; drop the config's checkpoint engine settings"
        )
    current.load = safe_load


def check_checkpoint_files(directory: Path) -> None:
    """Read every ``.pt`` file under ``directory`` with :func:`safe_load` (before DeepSpeed's own converter, which
    unpickles them, reads them all)."""
    for path in sorted(directory.rglob("*.pt")):
        safe_load(path, map_location="cpu")
