"""`from_hf`: a local Hugging Face model directory of the Llama family as an lmcore GPT, read tensor by tensor.

The model is built on the meta device (no memory, no initialisation) and each tensor of the safetensors file(s)
is read once, converted to the target dtype and assigned in place of its meta parameter: the peak is about one
copy of the weights plus one tensor in flight (`tools/smollm2_base.py` measures it). A tensor read on the CPU in
its stored dtype is not copied at all: safetensors maps the file privately, so the parameter shares the file's
pages and a write to it (training) copies the page it touches, never the file. Replace such a file (write a new one
and rename it, as `lmcore.save_hf` does) rather than rewriting it in place while the model is alive. Weights are
read from safetensors only (`model.safetensors`, or the shards a `model.safetensors.index.json` names); nothing is
ever unpickled. Every bad input is an `HFImportError`, one line naming the file and field, what was expected and
found, and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lmcore.config import ModelConfig
from lmcore.hf_llama import HFImportError, HFSource, architecture_of, config_from_hf, hf_name, lmcore_name
from lmcore.model import GPT, Attention

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# safetensors' dtype names -> torch dtypes (the floating ones a checkpoint of this family holds).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Tensors some checkpoints carry that no model computes from (older Llama files stored the rotary frequencies).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json of a Hugging Face model directory as a dict, or HFImportError naming what is wrong.

    Example:
        >>> read_hf_config("/no/such/dir")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmcore.hf_llama.HFImportError: /no/such/dir: not a directory: expected a Hugging Face model directory ...
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise HFImportError(
            f"{directory}: not a directory: expected a Hugging Face model directory with "
            f"{CONFIG_NAME} and {WEIGHTS_NAME}; fix: pass the directory save_pretrained wrote"
        )
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise HFImportError(
            f"{directory}: {CONFIG_NAME} missing: expected a Hugging Face model directory with "
            f"{CONFIG_NAME} and {WEIGHTS_NAME}; fix: pass the directory save_pretrained wrote"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFImportError(f"{path}: not JSON ({exc}); fix: restore the file save_pretrained wrote") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{path}: holds a {type(config).__name__}: expected a JSON object of model settings")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise HFImportError(
            f"{path}: quantization_config (quant_method={method!r}): expected unquantized weights; "
            "fix: use the checkpoint's unquantized release, or dequantize it with its library first"
        )
    return config


def weight_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model directory: `model.safetensors`, or every shard its index names (each a
    plain file name inside the directory). A directory with only pickled weights gets one line saying how to
    convert them.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     weight_files(d)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmcore.hf_llama.HFImportError: ...: no model.safetensors or model.safetensors.index.json: ...
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        return _shards(directory, index)
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
    if pickled:
        raise HFImportError(
            f"{directory}: {pickled[0]} but no {WEIGHTS_NAME}: expected safetensors weights (lmcore never unpickles a "
            f'weights file); fix: convert it once where you trust the file: python -c "from transformers import '
            f"AutoModelForCausalLM as M; M.from_pretrained('{directory}').save_pretrained('{directory}')\""
        )
    raise HFImportError(
        f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}: expected the model's weights beside "
        f"{CONFIG_NAME}; fix: copy the weight files into the directory"
    )


def _shards(directory: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise HFImportError(
            f"{index}: not a JSON object ({exc}); fix: restore the index save_pretrained wrote"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFImportError(f"{index}: weight_map={weight_map!r}: expected an object of tensor name -> shard file")
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        # A path read from a file must stay inside its directory: a shard is a plain file name.
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise HFImportError(f"{index}: weight_map names shard {name!r}: expected a file name inside {directory}")
        if not (directory / name).is_file():
            raise HFImportError(
                f"{index}: weight_map names shard {name!r}, which is missing from {directory}; "
                "fix: copy every shard the index names"
            )
        shards.append(directory / name)
    return shards


def _target_dtype(files: list[Path], dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r}: expected a torch dtype name such as 'float32' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    if dtype is not None:
        assert isinstance(dtype, torch.dtype)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype}: expected a floating-point dtype")
        return dtype
    # None: the checkpoint's own precision, that of its token embedding.
    for path in files:
        with _open(path) as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                stored = f.get_slice("model.embed_tokens.weight").get_dtype()
                return SAFETENSORS_DTYPES.get(stored, torch.float32)
    return torch.float32


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:  # a pickle or any other file under the name: never unpickled
        raise HFImportError(f"{path}: not a readable safetensors file ({exc}); fix: restore the file") from None


# ModelConfig fields a caller of from_hf may set otherwise than config.json: none changes a tensor or the logits of
# one unpacked sequence.
FREE_FIELDS = ("dropout", "checkpointing", "attention_backend", "document_separator", "loss_logits")


def _shape_hint(config: ModelConfig) -> str:
    return (
        f"vocab_size={config.vocab_size}, hidden_size={config.d_model}, intermediate_size={config.d_ff}, "
        f"num_attention_heads={config.n_head}, num_key_value_heads={config.n_kv_head}"
    )


def from_hf(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    *,
    device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
) -> GPT:
    """The Llama/Qwen2/Mistral checkpoint in the local directory `path` as an lmcore GPT in eval mode, whose
    `model(ids).logits` equal transformers' (fp32: to 1e-5). `dtype` None keeps the checkpoint's precision; each
    tensor is converted once as it is read. `model.hf_source` (an `HFSource`) keeps the architecture and the
    config.json for the export back (`lmcore.save_hf`). `config` builds the model from another ModelConfig than
    the one config.json maps to: one that changes no tensor (dropout, activation checkpointing, the attention
    backend, a document separator), as a fine-tune's plan sets them; its shapes are checked against the weights like
    config.json's. Bad input raises `HFImportError` (a ValueError), one line.

    Example (a tiny random Qwen2 written by transformers; needs the hf extra for that part only):
        >>> import tempfile, torch
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> d = tempfile.TemporaryDirectory()
        >>> hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)).eval()
        >>> hf.save_pretrained(d.name)
        >>> model = from_hf(d.name)
        >>> ids = torch.randint(0, 100, (1, 12))
        >>> model.hf_source.architecture, torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-5)
        ('Qwen2ForCausalLM', True)
        >>> d.cleanup()
    """
    directory = Path(path)
    raw = read_hf_config(directory)
    where = str(directory / CONFIG_NAME)
    architecture = architecture_of(raw, where)
    mapped = config_from_hf(raw, where)
    if config is None:
        config = mapped
    else:
        changed = sorted(k for k, v in config.to_dict().items() if k not in FREE_FIELDS and mapped.to_dict()[k] != v)
        if changed:
            raise HFImportError(
                f"{where}: the config given for {changed[0]} is {getattr(config, changed[0])!r}, the checkpoint's "
                f"{getattr(mapped, changed[0])!r}: expected the checkpoint's computation (only {', '.join(FREE_FIELDS)}"
                " may differ); fix: leave those fields as config.json has them"
            )
    files = weight_files(directory)
    target = _target_dtype(files, dtype)
    with torch.device("meta"):
        model = GPT(config)
    expected = model.state_dict(keep_vars=True)  # name -> meta tensor (shape and kind)
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    unexpected: list[tuple[Path, str]] = []
    for file in files:
        with _open(file) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                ours = lmcore_name(key)
                if key.endswith(IGNORED_SUFFIXES) or (ours == "lm_head.weight" and config.tie_embeddings):
                    continue  # transformers ignores these too (a tied head stored anyway is the embedding)
                if ours is None or ours not in expected:
                    unexpected.append((file, key))
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[ours].shape):
                    raise HFImportError(
                        f"{file}: tensor {key} has shape {shape}: expected {tuple(expected[ours].shape)} from "
                        f"{where} ({_shape_hint(config)}); fix: use the config.json these weights were saved with"
                    )
                stored = f.get_slice(key).get_dtype()
                if stored not in SAFETENSORS_DTYPES:
                    raise HFImportError(
                        f"{file}: tensor {key} is {stored}: expected floating-point weights "
                        "(F32, BF16, F16); fix: dequantize the checkpoint first"
                    )
                state[ours] = f.get_tensor(key).to(device=device, dtype=target)
    if unexpected:
        file, key = unexpected[0]
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise HFImportError(
            f"{file}: unexpected tensor {key}{more}: expected only the tensors of {architecture} "
            f"with {where}; fix: use the weights saved with this config.json"
        )
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise HFImportError(
            f"{files[0] if len(files) == 1 else directory}: tensor {hf_name(missing[0])} missing"
            f"{more}: expected every tensor {where} implies; fix: copy the complete weights"
        )
    model.load_state_dict(state, strict=False, assign=True)  # every name checked above; the tied head is not stored
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True replaced the embedding's Parameter
    for module in model.modules():
        if isinstance(module, Attention) and not hasattr(module, "log_slopes"):
            module.slopes = module.fixed_slopes().to(device)  # a non-persistent buffer, still on the meta device
    model.hf_source = HFSource(architecture, raw, str(directory.resolve()))
    return model.eval()
