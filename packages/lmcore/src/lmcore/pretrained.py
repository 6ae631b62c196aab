"""save_pretrained / from_pretrained: `model.safetensors` plus `config.json`, checked against each other on load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from lmcore.config import ModelConfig

if TYPE_CHECKING:
    from lmcore.model import GPT

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def _storable_state(model: GPT) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_embeddings:
        # safetensors refuses two names for one storage; the tie is restored from the config on load.
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def save_pretrained(model: GPT, directory: str | Path) -> Path:
    """Write the weights (safetensors) and the config (JSON) of `model` into `directory`; returns the directory.

    Example:
        >>> save_pretrained(GPT(ModelConfig.from_preset("tiny")), "out/tiny")  # doctest: +SKIP
    """
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("model has LoRA adapters: merge_lora(model) first, or save the adapters with save_lora()")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_storable_state(model), str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    return directory


def load_pretrained(cls: type[GPT], directory: str | Path, map_location: str | torch.device = "cpu") -> GPT:
    """Build `cls(config)` from `directory/config.json` and load `directory/model.safetensors` into it.

    A key missing from or unexpected in the weights, or a shape that differs from what the config
    implies, raises ValueError naming the key and both shapes.
    """
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found (expected a save_pretrained directory)")
    try:
        config = ModelConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{directory / CONFIG_NAME}: {exc}") from exc
    model = cls(config)
    expected = _storable_state(model)
    weights = load_file(str(directory / WEIGHTS_NAME), device=str(map_location))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_NAME} does not match {directory / CONFIG_NAME}: "
            f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for key, tensor in weights.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{directory / WEIGHTS_NAME}: {key} has shape {tuple(tensor.shape)} but {directory / CONFIG_NAME} "
                f"implies {tuple(expected[key].shape)}"
            )
    model.to(device=map_location, dtype=weights["embed_tokens.weight"].dtype)  # keep the saved precision
    model.load_state_dict(weights, strict=False)  # lm_head.weight is tied, everything else was checked above
    return model
