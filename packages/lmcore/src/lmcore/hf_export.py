"""A Llama-family lmcore model back out as the Hugging Face architecture it came from, and its LoRA adapters as a
PEFT adapter directory for the original base.

`save_hf` writes config.json and model.safetensors that transformers loads as `LlamaForCausalLM`,
`Qwen2ForCausalLM` or `MistralForCausalLM` (no custom code): the architecture of `model.hf_source` (set by
`lmcore.from_hf`), whose config.json it starts from, so the keys lmcore does not model (token ids, the rope layout,
sliding-window settings that never applied) come back as they were; a model with no source (trained here with
`position="rope"`) becomes Qwen2 when it has q/k/v biases only and Llama otherwise. `save_peft_adapter` writes
`adapter_config.json` and `adapter_model.safetensors` in PEFT's layout (module names
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), which `peft.PeftModel.from_pretrained(base, dir)`
loads onto the base directory. Both need only safetensors; transformers and peft read the result.

Files are written beside their final name and renamed into place: a model that `from_hf` read from the same
directory shares the old file's pages (see `lmcore.hf_import`) and keeps them, since the old file lives on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmcore.file_writes import write_safetensors, write_text
from lmcore.hf_llama import ARCHITECTURES, HFSource, hf_config, hf_name, rope_layout
from lmcore.lora import lora_modules, lora_state

if TYPE_CHECKING:
    from lmcore.model import GPT

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Keys of a source config.json that describe settings lmcore leaves alone (they were checked not to apply on
# import); kept as the source has them instead of the values hf_config would write for a model with no source.
KEPT_FROM_SOURCE = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "attention_dropout",
                    "use_cache")  # fmt: skip
ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # safetensors writes a new file and renames it over the old one (an imported model may still map the old one)
    write_safetensors(tensors, path, metadata={"format": "pt"})


def _save_json(values: dict[str, Any], path: Path) -> None:
    write_text(path, json.dumps(values, indent=2, sort_keys=True) + "\n")


def default_architecture(model: GPT) -> str:
    """The architecture `save_hf` writes for `model`: its source's, else Qwen2 for q/k/v biases alone, else Llama.

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> default_architecture(GPT(ModelConfig.from_preset("tiny", position="rope", bias=False, qkv_bias=True)))
        'Qwen2ForCausalLM'
    """
    source = getattr(model, "hf_source", None)
    if source is not None:
        return str(source.architecture)
    config = model.config
    return "Qwen2ForCausalLM" if config.qkv_bias and not config.bias else "LlamaForCausalLM"


def export_config(model: GPT, architecture: str, dtype: torch.dtype, source: HFSource | None) -> dict[str, Any]:
    """The config.json dict `save_hf` writes: the source's (same architecture) updated with what `model.config`
    decides, in the source's rope layout."""
    dtype_name = str(dtype).removeprefix("torch.")
    base = dict(source.config) if source is not None and source.architecture == architecture else {}
    fresh = hf_config(model.config, architecture, rope_layout(base) if base else "v4", dtype_name)
    for key in KEPT_FROM_SOURCE:
        if key in base:
            fresh.pop(key, None)
    out = {k: v for k, v in base.items() if k not in ROPE_KEYS}
    out.update(fresh)
    if "torch_dtype" in base:  # transformers 4's name for it
        out["torch_dtype"] = dtype_name
    return out


def save_hf(
    model: GPT,
    directory: str | os.PathLike[str],
    *,
    architecture: str | None = None,
    dtype: torch.dtype | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` as a Hugging Face directory of `architecture` (default: `default_architecture(model)`):
    config.json and model.safetensors in `dtype` (default: the model's). `extra_config` adds or replaces keys of
    config.json (e.g. `eos_token_id`). A model with LoRA adapters is refused: `merge_lora` it first, or write the
    adapters with `save_peft_adapter`. ValueError naming the fields when the model does not map.

    Example:
        >>> import json, tempfile
        >>> from lmcore import GPT, ModelConfig
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False)
        >>> out = tempfile.TemporaryDirectory()
        >>> directory = save_hf(GPT(cfg), out.name)
        >>> json.loads((directory / "config.json").read_text())["architectures"]
        ['LlamaForCausalLM']
        >>> out.cleanup()
    """
    if lora_modules(model):
        raise ValueError("save_hf takes a plain model: merge_lora(model) first, or write the adapters with "
                         "save_peft_adapter")  # fmt: skip
    architecture = architecture or default_architecture(model)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: expected one of {', '.join(ARCHITECTURES)}")
    dtype = dtype or model.embed_tokens.weight.dtype
    config = export_config(model, architecture, dtype, getattr(model, "hf_source", None))
    config.update(extra_config or {})
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # transformers ties it back from tie_word_embeddings
    tensors = {hf_name(k): v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save_tensors(tensors, directory / "model.safetensors")
    _save_json(config, directory / "config.json")
    return directory


def peft_adapter_config(model: GPT, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The adapter_config.json dict of `model`'s LoRA adapters (PEFT's LoraConfig fields that matter here)."""
    settings = model.lora_settings
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings["r"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": sorted(settings["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(
    model: GPT,
    directory: str | os.PathLike[str],
    base_model_name_or_path: str | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the LoRA adapters of `model` as a PEFT adapter directory for its Hugging Face base (by default the
    directory `model.hf_source` names). `tensors`: the adapters as `lmcore.lora_state` gathered them (on every rank,
    for adapters sharded over ranks); by default read off the model.

    Example:
        >>> import json, tempfile
        >>> from lmcore import GPT, ModelConfig, apply_lora
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False)
        >>> model = apply_lora(GPT(cfg), targets=["q", "v"], r=4)
        >>> out = tempfile.TemporaryDirectory()
        >>> config = json.loads((save_peft_adapter(model, out.name, "base") / "adapter_config.json").read_text())
        >>> config["peft_type"], config["r"], config["target_modules"], config["base_model_name_or_path"]
        ('LORA', 4, ['q_proj', 'v_proj'], 'base')
        >>> out.cleanup()
    """
    if not lora_modules(model):
        raise ValueError("the model has no LoRA adapters to export")
    architecture = default_architecture(model)
    hf_config(model.config, architecture)  # the base must map (ValueError naming the fields otherwise)
    if base_model_name_or_path is None and getattr(model, "hf_source", None) is not None:
        base_model_name_or_path = model.hf_source.directory
    tensors = lora_state(model) if tensors is None else tensors
    peft_tensors = {}
    for name, tensor in tensors.items():
        module, _, part = name.rpartition(".")  # "layers.0.self_attn.q_proj", "lora_A"
        hf_module = hf_name(f"{module}.weight").removesuffix(".weight")
        peft_tensors[f"base_model.model.{hf_module}.{part}.weight"] = tensor.detach().to("cpu").contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save_tensors(peft_tensors, directory / ADAPTER_WEIGHTS)
    _save_json(peft_adapter_config(model, base_model_name_or_path), directory / ADAPTER_CONFIG)
    return directory
