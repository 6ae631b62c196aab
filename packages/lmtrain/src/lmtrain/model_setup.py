"""Building the model config for a run: preset or config file, the data's vocabulary, `--set` overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError


def base_model_config(preset: str | None, model_config: str | None, vocab_size: int | None = None) -> Any:
    """The lmcore ModelConfig from a preset name or a config.json, with the tokenizer's vocabulary size.

    A config file's own vocab_size is kept when it is at least the tokenizer's (a padded vocabulary); smaller is
    an error, since token ids beyond the embedding table fail deep inside the model (device-side asserts on GPU).

    Example:
        >>> base_model_config("tiny", None, vocab_size=300).vocab_size
        300
    """
    from lmcore import PRESETS, ModelConfig

    if model_config:
        path = Path(model_config)
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LmtrainError(f"--model-config {path}: cannot read a JSON object: {exc}") from exc
        try:
            config = ModelConfig.from_dict(values)
        except (ValueError, TypeError) as exc:
            raise LmtrainError(f"--model-config {path}: {exc}") from exc
        if vocab_size is not None and config.vocab_size < vocab_size:
            if "vocab_size" in values:
                raise LmtrainError(
                    f"--model-config {path}: vocab_size={config.vocab_size} is smaller than the tokenizer's "
                    f"{vocab_size}; token ids would index past the embedding table"
                )
            config.vocab_size = vocab_size
        return config
    name = preset or "cpu-small"
    if name not in PRESETS:
        raise LmtrainError(f"--preset {name!r} is unknown; known presets: {', '.join(PRESETS)}")
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    return ModelConfig.from_preset(name, **overrides)


def estimate_run_memory(preset: str, n_gpus: int = 1) -> tuple[int, int]:
    """(parameter count, estimated peak bytes per GPU) for `preset` with the preset's training recipe.

    Example:
        >>> n, per_gpu = estimate_run_memory("1.3b", n_gpus=16)  # ZeRO-2 over 16 GPUs, optimizer states on the CPU
        >>> f"{n / 1e9:.2f}B parameters, {per_gpu / 2**30:.1f} GiB per GPU"
        '1.27B parameters, 9.8 GiB per GPU'
    """
    import lmcore
    from lmtrain.recipes import train_recipe

    config = base_model_config(preset, None)
    recipe = train_recipe(preset)
    estimate = lmcore.estimate_memory(
        config,
        recipe.get("micro_batch", 1),
        config.context_length,
        recipe.get("precision", "bf16"),
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
