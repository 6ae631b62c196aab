"""What a run's model needs of the machine: the memory estimate of a recipe, the attention backend's device."""

from __future__ import annotations

from typing import Any

from lmtrain.errors import LmtrainError


def estimate_run_memory(preset: str, n_gpus: int = 1) -> tuple[int, int]:
    """(parameter count, estimated peak bytes per GPU) for `preset` with the preset's training recipe.

    Example:
        >>> n, per_gpu = estimate_run_memory("1.3b", n_gpus=16)  # ZeRO-2 over 16 GPUs, optimizer states on the CPU
        >>> f"{n / 1e9:.2f}B parameters, {per_gpu / 2**30:.1f} GiB per GPU"
        '1.27B parameters, 5.9 GiB per GPU'
    """
    import lmcore
    from lmtrain.recipes import recipe_named

    recipe = recipe_named(preset)
    config, train_cfg = recipe.model_config(), recipe.train_config()
    estimate = lmcore.estimate_memory(
        config,
        train_cfg.micro_batch,
        config.context_length,
        train_cfg.precision,
        zero_stage=2,
        world_size=n_gpus,
        offload_optimizer=True,
    )
    return estimate.n_params, estimate.total


def check_attention_backend(model_cfg: Any, device: Any) -> None:
    """Refuse, in one line, a config whose `attention_backend='triton'` cannot run on `device` (the Triton kernels
    need a CUDA GPU, or TRITON_INTERPRET=1 on the CPU for tests)."""
    if model_cfg.attention_backend != "triton":
        return
    from alibi_kernels import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise LmtrainError(
            f"attention_backend='triton' cannot run on {device}: {reason}; here: --set attention_backend=auto "
            "(Triton on a CUDA GPU, PyTorch elsewhere)"
        )
