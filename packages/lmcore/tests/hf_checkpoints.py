"""Tiny random Llama-family checkpoints written by transformers itself (no download), for the import/export tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)  # fmt: skip
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]
# Each architecture's settings beyond SHAPE (Mistral's sliding window off: lmcore refuses one shorter than the context).
EXTRA = {"LlamaForCausalLM": {}, "Qwen2ForCausalLM": {}, "MistralForCausalLM": {"sliding_window": None}}


def hf_classes(architecture: str) -> tuple[Any, Any]:
    import transformers

    prefix = architecture.removesuffix("ForCausalLM")
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, architecture)


def random_hf(architecture: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model with random weights, random norm weights and biases too (all of them matter)."""
    config_class, model_class = hf_classes(architecture)
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **EXTRA[architecture], **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def write_checkpoint(directory: Path, architecture: str, seed: int = 0, **overrides: Any) -> Any:
    """Save a random model with transformers' save_pretrained into `directory`; returns the model."""
    model = random_hf(architecture, seed, **overrides)
    model.save_pretrained(directory)
    return model


def rewrite_config(directory: Path, **changes: Any) -> dict:
    """Change keys of directory/config.json (a value None removes the key); returns the new dict."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return config


def as_transformers4(directory: Path) -> dict:
    """Rewrite a transformers 5 config.json (rope_parameters) in transformers 4's layout (top-level rope_theta and
    rope_scaling), as most published checkpoints have it."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(config, indent=2))
    return config
