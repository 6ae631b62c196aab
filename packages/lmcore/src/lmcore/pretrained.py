"""save_pretrained / from_pretrained: `model.safetensors` plus `config.json`, checked against each other on load.

One layout for every use: `GPT.save_pretrained(dir)`, and trainloop's checkpoints, which call
`save_pretrained(dir, state_dict=consolidated)` so that `GPT.from_pretrained(checkpoint_dir)` loads any checkpoint.
A tied output head is stored once (under `embed_tokens.weight`). A model with LoRA adapters is saved as it is,
base weights (`...q_proj.base.weight`) and adapters (`...q_proj.lora_A`) under the module's own names, with the
adapter settings in the safetensors metadata; `from_pretrained` applies the adapters again before loading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from lmcore.config import ModelConfig
from lmcore.file_writes import write_safetensors, write_text
from lmcore.lora import apply_lora, base_fingerprint, lora_modules, read_lora_settings

if TYPE_CHECKING:
    from lmcore.model import GPT

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
LORA_METADATA = "lora_settings"


def _storable_names(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state_dict less the tied output head: what the weights file holds, by name."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        # safetensors refuses two names for one storage; the tie is restored from the config on load.
        state.pop("lm_head.weight", None)
    return state


def save_pretrained(model: GPT, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the weights (safetensors) and the config (JSON) of `model` into `directory`; returns the directory.

    `state_dict` (None: the model's own) supplies the tensors under the model's state_dict names, e.g. weights
    consolidated from several ranks; they are written in their own dtype. A name the model does not have, or one
    it has that is missing, raises ValueError. Adapters of `apply_lora` are saved with the base weights (module
    docstring); merge them first (`merge_lora`) for a plain model.

    Example:
        >>> import os, tempfile, torch
        >>> from lmcore import GPT, ModelConfig
        >>> out = tempfile.TemporaryDirectory()
        >>> model = GPT(ModelConfig.from_preset("tiny")).eval()
        >>> directory = save_pretrained(model, f"{out.name}/tiny")
        >>> sorted(os.listdir(directory))
        ['config.json', 'model.safetensors']
        >>> ids = torch.randint(0, 97, (1, 8))
        >>> torch.equal(GPT.from_pretrained(directory).eval()(ids).logits, model(ids).logits)
        True
        >>> out.cleanup()
    """
    expected = _storable_names(model)
    state = dict(model.state_dict() if state_dict is None else state_dict)
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"save_pretrained: state_dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    metadata = {"format": "pt"}
    if lora_modules(model):
        metadata[LORA_METADATA] = json.dumps(model.lora_settings)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    write_safetensors(tensors, directory / WEIGHTS_NAME, metadata)
    write_text(directory / CONFIG_NAME, json.dumps(model.config.to_dict(), indent=2) + "\n")
    return directory


def read_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a save_pretrained directory (or checkpoint); ValueError naming the file when invalid."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected a save_pretrained directory)")
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_pretrained(cls: type[GPT], directory: str | Path, map_location: str | torch.device = "cpu") -> GPT:
    """Build `cls(config)` from `directory/config.json` and load `directory/model.safetensors` into it.

    A file that is not safetensors, a key missing from or unexpected in the weights, a shape that differs from what
    the config implies, or a tensor that is not floating point where the model's is, raises ValueError naming the
    file and the key. Saved adapters come back as LoRA modules.
    """
    directory = Path(directory)
    config = read_config(directory)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found (expected a save_pretrained directory)")
    try:
        with safe_open(str(weights_path), framework="pt", device=str(map_location)) as f:
            metadata = f.metadata() or {}
            weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    except SafetensorError as exc:  # e.g. a pickle or any other file under the name: never unpickled
        raise ValueError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    model = cls(config)
    if LORA_METADATA in metadata:
        settings = read_lora_settings(metadata[LORA_METADATA], weights_path)
        apply_lora(model, settings["targets"], settings["r"], settings["alpha"], settings["dropout"])
    expected = _storable_names(model)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not match {directory / CONFIG_NAME}: "
            f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for key, tensor in weights.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{weights_path}: {key} has shape {tuple(tensor.shape)} but {directory / CONFIG_NAME} "
                f"implies {tuple(expected[key].shape)}"
            )
        if expected[key].is_floating_point() and not tensor.is_floating_point():
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise ValueError(f"{weights_path}: {key} is {dtype}, expected a floating-point tensor (float32, bfloat16 "
                             "or float16) as save_pretrained writes")  # fmt: skip
    model.to(device=map_location, dtype=weights["embed_tokens.weight"].dtype)  # keep the saved precision
    model.load_state_dict(weights, strict=False)  # lm_head.weight is tied, everything else was checked above
    if lora_modules(model):  # the base the adapters sit on is the one just loaded, not the one they were applied to
        model.lora_base_sha256 = base_fingerprint(model)  # type: ignore[assignment]
    return model
