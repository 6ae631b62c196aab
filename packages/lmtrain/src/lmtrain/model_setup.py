"""What a run's model needs of the machine: the memory estimate of a recipe, the attention backend's device."""

from __future__ import annotations

from typing import Any

from lmtrain.errors import LmtrainError

ENGINE_LAYOUTS = ("torch", "fsdp", "fsdp + CPU offload", "deepspeed ZeRO-2 + offload")


def estimate_run_memory(preset: str, n_gpus: int = 1, engine: str = "deepspeed ZeRO-2 + offload") -> tuple[int, int]:
    """(parameter count, estimated peak bytes per GPU) for `preset` with the preset's training recipe under
    `engine`, one of ENGINE_LAYOUTS: plain torch/DDP (full replicas: ZeRO stage 0), FSDP (lmcore's
    estimate_fsdp_memory, with the recipe's accumulation), FSDP with CPU offload, DeepSpeed ZeRO-2 with the optimizer
    offloaded (the cluster kit's configuration).

    Example:
        >>> n, per_gpu = estimate_run_memory("1.3b", n_gpus=16)  # ZeRO-2 over 16 GPUs, optimizer states on the CPU
        >>> f"{n / 1e9:.2f}B parameters, {per_gpu / 2**30:.1f} GiB per GPU"
        '1.27B parameters, 5.9 GiB per GPU'
        >>> f"{estimate_run_memory('1.3b', n_gpus=16, engine='fsdp')[1] / 2**30:.1f} GiB per GPU under FSDP"
        '10.1 GiB per GPU under FSDP'
    """
    import lmcore
    from lmtrain.recipes import recipe_named

    if engine not in ENGINE_LAYOUTS:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINE_LAYOUTS)}")
    recipe = recipe_named(preset)
    config, train_cfg = recipe.model_config(), recipe.train_config()
    shape = (config, train_cfg.micro_batch, config.context_length, train_cfg.precision)
    if engine.startswith("fsdp"):
        estimate = lmcore.estimate_fsdp_memory(*shape, world_size=n_gpus, cpu_offload=engine != "fsdp",
                                               gradient_accumulation_steps=train_cfg.grad_accum)  # fmt: skip
    elif engine == "torch":
        estimate = lmcore.estimate_memory(*shape, zero_stage=0, world_size=n_gpus)
    else:
        estimate = lmcore.estimate_memory(*shape, zero_stage=2, world_size=n_gpus, offload_optimizer=True)
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
