"""Any lmcore model as a Hugging Face directory with its own code (`trust_remote_code=True`).

The directory holds copies of the lmcore and alibi-kernels source files the model needs, their package imports
rewritten to relative ones, so the code that runs is this toolkit's own model, with no import of lmcore:
transformers copies the files into its module cache and imports them. A thin `PreTrainedModel` wraps `GPT`
(attention on the torch path: SDPA with the ALiBi bias, on every device). Weights are the model's own state_dict
under `model.`; the tied output head is stored once.

Generation through `transformers.GenerationMixin` decodes with lmcore's own KV cache (`past_key_values` is an
`LmcoreCache`; `use_cache=False` recomputes the whole sequence for each token, and is the default of a model with
a document separator, whose attention stays inside documents only without a cache) and takes no padding (an
attention_mask with zeros is an error).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from lmcore.file_writes import write_safetensors, write_text

if TYPE_CHECKING:
    from lmcore.model import GPT

MODEL_TYPE = "lmcore_gpt"
# Source module -> file name in the export; every package import among them becomes a relative one.
SOURCE_FILES = {
    "alibi_kernels.slopes": "alibi_kernels_slopes",
    "alibi_kernels.validation": "alibi_kernels_validation",
    "alibi_kernels.attention_torch": "alibi_kernels_attention_torch",
    "lmcore.config": "lmcore_config",
    "lmcore.documents": "lmcore_documents",
    "lmcore.file_writes": "lmcore_file_writes",
    "lmcore.init_schemes": "lmcore_init_schemes",
    "lmcore.lora": "lmcore_lora",
    "lmcore.pretrained": "lmcore_pretrained",
    "lmcore.rope": "lmcore_rope",
    "lmcore.model": "lmcore_model",
}
# `import alibi_kernels` in the copies resolves to this: the torch path of `alibi_attention` and
# `alibi_attention_varlen` (same signatures; the Triton kernels are not shipped).
ALIBI_SHIM = '''"""alibi_kernels' public attention calls on the torch path only (the Triton kernels are not shipped)."""

from .alibi_kernels_attention_torch import torch_attention_checked, torch_varlen_checked
from .alibi_kernels_slopes import alibi_slopes  # noqa: F401 (re-exported for lmcore_model)
from .alibi_kernels_validation import check_attention_inputs, check_document_starts, check_varlen_inputs

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend, device):
    return "torch"


def alibi_attention(q, k, v, slopes=None, *, causal=True, softmax_scale=None, backend="auto", document_starts=None):
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    if document_starts is not None:
        check_document_starts(document_starts, shape, slopes_2d, causal, q.device)
    return torch_attention_checked(q, k, v, shape, slopes_2d, scale, causal, document_starts)


def alibi_attention_varlen(
    q, k, v, cu_seqlens, max_seqlen=None, slopes=None, *, causal=True, softmax_scale=None, backend="auto"
):
    shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, slopes, softmax_scale, True)
    return torch_varlen_checked(q, k, v, shape, slopes_2d, scale, causal)
'''
CONFIGURATION = '''"""The Hugging Face config of an lmcore GPT: the lmcore ModelConfig fields under `lmcore`."""

from transformers import PretrainedConfig

from .lmcore_config import ModelConfig


class LmcoreConfig(PretrainedConfig):
    model_type = "%(model_type)s"

    def __init__(self, lmcore=None, **kwargs):
        self.lmcore = dict(lmcore or {})
        config = ModelConfig.from_dict(self.lmcore) if lmcore else None
        if config is not None:
            self.vocab_size = config.vocab_size
            self.hidden_size = config.d_model
            self.num_hidden_layers = config.n_layer
            self.num_attention_heads = config.n_head
            kwargs.setdefault("tie_word_embeddings", config.tie_embeddings)
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)
'''
MODELING = '''"""transformers' causal-LM interface around the lmcore GPT, whose code is in the lmcore_*.py files."""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_lmcore import LmcoreConfig
from .lmcore_model import GPT, KVCache, ModelConfig

# The output's field for the cache: `cache` from transformers 5, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class LmcoreCache(KVCache):
    """lmcore's KV cache (each layer's keys and values so far), with the length transformers' generation asks."""

    def get_seq_length(self, layer_idx=0):
        return len(self)


class LmcoreForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LmcoreConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        model_config = ModelConfig.from_dict({**config.lmcore, "attention_backend": "torch"})
        self.model = GPT(model_config)
        if model_config.tie_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}
        self.post_init()

    def _init_weights(self, module):
        # Weights come from the checkpoint; the fixed slopes (ALiBi's, or zeros with RoPE) are a buffer that no
        # checkpoint carries.
        if hasattr(module, "slopes") and not hasattr(module, "log_slopes"):
            module.slopes = module.fixed_slopes().to(module.slopes.device)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, use_cache=None, **kwargs):
        # With lmcore's cache, only the positions it does not hold yet run. transformers 5 passes the cache as
        # `cache`, earlier releases as `past_key_values`.
        cache = _lmcore_cache(kwargs.get("cache", kwargs.get("past_key_values")))
        if cache is not None and len(cache) > 0:
            input_ids = input_ids[:, len(cache) :]
        return {"input_ids": input_ids, "attention_mask": attention_mask, CACHE_FIELD: cache, "use_cache": use_cache}

    def forward(self, input_ids=None, attention_mask=None, labels=None, cache=None, past_key_values=None,
                use_cache=None, return_dict=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model takes no padding: pass unpadded sequences of equal length")
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        cache = _lmcore_cache(cache if cache is not None else past_key_values)
        if cache is None and use_cache and labels is None:
            cache = LmcoreCache(self.model.config.n_layer)
        logits = self.model(input_ids, kv_cache=cache).logits  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})


def _lmcore_cache(cache):
    """lmcore's cache, or None for anything else (None, or a cache object of transformers' own that a release
    creates on its own)."""
    return cache if isinstance(cache, KVCache) else None
'''


def _relative_source(module_name: str) -> str:
    """The source of `module_name` with its imports of lmcore and alibi_kernels made relative to the export."""
    text = inspect.getsource(importlib.import_module(module_name))

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        local = "alibi_kernels" if target == "alibi_kernels" else SOURCE_FILES.get(target)
        if local is None:
            raise RuntimeError(f"{module_name} imports {target}, which the custom-code export does not ship")
        return f"{match.group(1)}from .{local} import"

    return re.sub(r"^(\s*)from ((?:lmcore|alibi_kernels)(?:\.\w+)?) import", rewrite, text, flags=re.MULTILINE)


def write_custom_code(directory: str | Path) -> list[str]:
    """Write the configuration, modeling and lmcore source files into `directory`; returns the file names.

    Example:
        >>> import tempfile
        >>> out = tempfile.TemporaryDirectory()
        >>> write_custom_code(out.name)  # doctest: +ELLIPSIS
        ['alibi_kernels.py', ..., 'configuration_lmcore.py', ..., 'lmcore_model.py', ..., 'modeling_lmcore.py']
        >>> out.cleanup()
    """
    directory = Path(directory)
    files = {f"{local}.py": _relative_source(module) for module, local in SOURCE_FILES.items()}
    files["alibi_kernels.py"] = ALIBI_SHIM
    files["configuration_lmcore.py"] = CONFIGURATION % {"model_type": MODEL_TYPE}
    files["modeling_lmcore.py"] = MODELING
    for name, text in files.items():
        write_text(directory / name, text)
    return sorted(files)


def save_custom(
    model: GPT,
    directory: str | Path,
    *,
    extra_config: dict | None = None,
    adapter_dir: str | Path | None = None,
    base_name: str | None = None,
) -> Path:
    """Write `model` as a transformers directory with its own code: config.json (with `auto_map`), model.safetensors
    and the code files. `extra_config` adds keys to config.json (e.g. `eos_token_id`). A model with LoRA adapters
    needs `adapter_dir`: its frozen base goes to `directory`, its adapters to `adapter_dir` in PEFT's layout, for
    `peft.PeftModel.from_pretrained(base, adapter_dir)` on the loaded base (or `merge_lora(model)` first); its
    `base_model_name_or_path` is `base_name`, by default `directory`'s absolute path.

    Load it with `AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`.

    Example:
        >>> import json, tempfile
        >>> from lmcore import GPT, ModelConfig
        >>> out = tempfile.TemporaryDirectory()
        >>> directory = save_custom(GPT(ModelConfig.from_preset("tiny", activation="swiglu")), f"{out.name}/custom")
        >>> json.loads((directory / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        'modeling_lmcore.LmcoreForCausalLM'
        >>> (directory / "model.safetensors").is_file()
        True
        >>> out.cleanup()
    """
    from lmcore.lora import lora_modules

    adapted = lora_modules(model)
    if adapted and adapter_dir is None:
        raise ValueError(
            "the custom-code export of a model with LoRA adapters needs adapter_dir (PEFT's layout) for them, or "
            "merge_lora(model) first"
        )
    if adapter_dir is not None and not adapted:
        raise ValueError("adapter_dir: the model has no LoRA adapters to write")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_custom_code(directory)
    state = base_state(model)
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    tensors = {f"model.{k}": v.detach().to("cpu").contiguous() for k, v in state.items()}
    write_safetensors(tensors, directory / "model.safetensors", {"format": "pt"})
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    config = {
        "architectures": ["LmcoreForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": {
            "AutoConfig": "configuration_lmcore.LmcoreConfig",
            "AutoModelForCausalLM": "modeling_lmcore.LmcoreForCausalLM",
        },
        "lmcore": model.config.to_dict(),
        "vocab_size": model.config.vocab_size,
        "tie_word_embeddings": model.config.tie_embeddings,
        # lmcore's cache holds no document boundaries: a model that keeps attention inside documents recomputes
        "use_cache": model.config.document_separator is None,
        "dtype": dtype,
        **(extra_config or {}),
    }
    write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
    if adapter_dir is not None:
        save_custom_adapter(model, adapter_dir, base_name or str(directory.resolve()))
    return directory


def base_state(model: GPT) -> dict:
    """The state_dict of the plain model under `model`'s LoRA adapters: each adapted layer's frozen weight and bias
    under the layer's own name, no adapter tensors (the model unchanged)."""
    from lmcore.lora import lora_modules

    adapted = lora_modules(model)
    state = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in adapted and leaf in ("lora_A", "lora_B"):
            continue
        layer, _, inner = module.rpartition(".")
        state[f"{layer}.{leaf}" if layer in adapted and inner == "base" else name] = tensor
    return state


def save_custom_adapter(model: GPT, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """`model`'s LoRA adapters as a PEFT adapter directory for its custom-code export (`save_custom`): the same
    module names (`model.layers.N.self_attn.q_proj`, ...), `lora_alpha / r` the same scaling."""
    from lmcore.hf_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config
    from lmcore.lora import lora_state

    tensors = {}
    for name, tensor in lora_state(model).items():
        module, _, part = name.rpartition(".")  # "layers.0.self_attn.q_proj", "lora_A"
        tensors[f"base_model.model.model.{module}.{part}.weight"] = tensor.detach().to("cpu").contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, directory / ADAPTER_WEIGHTS, {"format": "pt"})
    config = peft_adapter_config(model, base_model_name_or_path)
    write_text(directory / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
