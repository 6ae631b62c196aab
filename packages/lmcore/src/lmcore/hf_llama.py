"""The Llama family of Hugging Face checkpoints (Llama, Qwen2, Mistral) as lmcore configs and names, both ways.

What a family must provide lives here, with no I/O: which `architectures` it covers, how its config.json maps
onto a `ModelConfig` (and back), and how its tensor names map onto lmcore's. `lmcore.hf_import` reads a
directory with it and `lmcore.hf_export` writes one.

The three differ only in config: Qwen2 puts a bias on q, k and v (not on o_proj or the MLP) and may turn on a
sliding window per layer (`use_sliding_window`); Mistral has a sliding window (`sliding_window`, null in recent
releases); Llama has `attention_bias` and `mlp_bias` switches and the Llama 3 rope scaling. All three are
pre-RMSNorm, SwiGLU, grouped-query attention with rotary positions, tied or untied embeddings.

config.json comes in two layouts: transformers 4 writes `rope_theta` and `rope_scaling` at the top level (most
published checkpoints), transformers 5 writes `rope_parameters` ({"rope_theta", "rope_type", ...}). Both are read;
an export keeps the layout of the checkpoint it came from (transformers 4's for a model without one, which both
read).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lmcore.config import ModelConfig

# architectures[0] -> model_type.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# What each architecture's config class assumes for a key config.json leaves out (transformers 5.x defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "qwen2": {
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },  # fmt: skip
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
}
COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Hugging Face rope_type -> ModelConfig.rope_scaling.
ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic", "llama3": "llama3"}
# Inside a layer: Hugging Face module name -> lmcore's (the attention and MLP projections keep their names).
LAYER_RENAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}  # fmt: skip


class HFImportError(ValueError):
    """A Hugging Face model directory lmcore cannot read as it is; the message names the file and field, what was
    expected and found, and the fix."""


@dataclass(frozen=True)
class HFSource:
    """Where a model imported by `lmcore.from_hf` came from: its architecture, its config.json as read and the
    directory, so that an export writes the same architecture (`lmcore.save_hf`) and a PEFT adapter can name its
    base. JSON-able through `to_dict` / `from_dict` (a run records it beside its own config).

    Example:
        >>> source = HFSource("Qwen2ForCausalLM", {"model_type": "qwen2"}, "/models/qwen")
        >>> HFSource.from_dict(source.to_dict()) == source
        True
    """

    architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    directory: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "config": dict(self.config), "directory": self.directory}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HFSource:
        return cls(str(values["architecture"]), dict(values.get("config") or {}), str(values.get("directory", "")))


def architecture_of(config: dict[str, Any], where: str = "config.json") -> str:
    """The supported architecture `config` names (`architectures[0]`, or its `model_type` when that list is absent,
    as in a config derived from a GGUF file), or HFImportError.

    Example:
        >>> architecture_of({"architectures": ["Qwen2ForCausalLM"]}), architecture_of({"model_type": "llama"})
        ('Qwen2ForCausalLM', 'LlamaForCausalLM')
    """
    names = config.get("architectures")
    if names:
        name = names[0] if isinstance(names, list) else names
        if name not in ARCHITECTURES:
            raise HFImportError(
                f"{where}: architectures={names!r}: expected one of {', '.join(ARCHITECTURES)}; found {name!r}, which "
                "lmcore does not map (see docs/model-families.md for adding a family)"
            )
        return str(name)
    by_type = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
    model_type = config.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise HFImportError(
        f"{where}: architectures is missing and model_type={model_type!r}: expected one of {', '.join(ARCHITECTURES)}; "
        'fix: add "architectures": ["LlamaForCausalLM"] (or the model\'s class) to config.json'
    )


def _rope(config: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """(the rope parameters as one dict with "rope_type" and "rope_theta", "v4" or "v5": the layout found)."""
    if config.get("rope_parameters") is not None:
        params = dict(config["rope_parameters"])
        if not isinstance(config["rope_parameters"], dict) or any(isinstance(v, dict) for v in params.values()):
            raise HFImportError(
                f"{where}: rope_parameters={config['rope_parameters']!r}: expected one dict of rope "
                "settings for every layer; found settings per layer type, which lmcore does not map"
            )
        params.setdefault("rope_theta", config.get("rope_theta", COMMON_DEFAULTS["rope_theta"]))
        layout = "v5"
    else:
        params = dict(config.get("rope_scaling") or {})
        params["rope_theta"] = config.get("rope_theta", COMMON_DEFAULTS["rope_theta"])
        layout = "v4"
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params, layout


def _number(params: dict[str, Any], key: str, where: str, layout: str, default: Any = None) -> Any:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        label = f"rope_parameters.{key}" if layout == "v5" else key if key == "rope_theta" else f"rope_scaling.{key}"
        raise HFImportError(f"{where}: {label}={value!r}: expected a number; found none; fix the value in config.json")
    return value


def config_from_hf(config: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Llama/Qwen2/Mistral config.json dict (transformers 4 or 5 layout); anything lmcore
    cannot compute exactly (another architecture or rope type, a sliding window shorter than the context, partial
    rotary dims, a head_dim other than hidden_size / heads, an activation other than silu) is an HFImportError
    naming `where` and the field.

    Example:
        >>> cfg = config_from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...     "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
        >>> cfg.position, cfg.rope_theta, cfg.qkv_bias, cfg.bias, cfg.n_kv_head, cfg.context_length
        ('rope', 1000000.0, True, False, 2, 32768)
    """
    arch = architecture_of(config, where)
    model_type = ARCHITECTURES[arch]
    values = {**COMMON_DEFAULTS, **DEFAULTS[model_type], **config}
    missing = [key for key in REQUIRED if key not in config]
    if missing:
        raise HFImportError(
            f"{where}: {', '.join(missing)} missing: expected every one of {', '.join(REQUIRED)} "
            f"for {arch}; fix: add them to config.json"
        )
    d_model, n_head = values["hidden_size"], values["num_attention_heads"]
    if values["hidden_act"] != "silu":
        raise HFImportError(
            f"{where}: hidden_act={values['hidden_act']!r}: expected 'silu' (SwiGLU), the only MLP "
            f"lmcore maps for {arch}"
        )
    head_dim = values.get("head_dim")
    if head_dim is not None and isinstance(d_model, int) and isinstance(n_head, int) and n_head and \
            head_dim != d_model // n_head:  # fmt: skip
        raise HFImportError(
            f"{where}: head_dim={head_dim}: expected hidden_size / num_attention_heads = "
            f"{d_model // n_head} (lmcore derives it); found a decoupled head size"
        )
    _refuse_sliding_window(model_type, values, where)
    bias, qkv_bias = _biases(model_type, values, where)
    rope, layout = _rope(config, where)
    rope_fields = _rope_fields(rope, values["max_position_embeddings"], where, layout)
    try:
        return ModelConfig(
            vocab_size=values["vocab_size"],
            n_layer=values["num_hidden_layers"],
            n_head=n_head,
            n_kv_head=values.get("num_key_value_heads") or n_head,
            d_model=d_model,
            d_ff=values["intermediate_size"],
            context_length=values["max_position_embeddings"],
            norm="rmsnorm",
            norm_eps=values["rms_norm_eps"],
            activation="swiglu",
            dropout=0.0,
            bias=bias,
            qkv_bias=qkv_bias,
            tie_embeddings=bool(values["tie_word_embeddings"]),
            **rope_fields,
        )
    except ValueError as exc:
        raise HFImportError(f"{where}: {exc}") from None


def _refuse_sliding_window(model_type: str, values: dict[str, Any], where: str) -> None:
    window, context = values.get("sliding_window"), values["max_position_embeddings"]
    if model_type == "qwen2":
        layer_types = values.get("layer_types") or []
        per_layer = "sliding_attention" in layer_types if layer_types else \
            values["max_window_layers"] < values["num_hidden_layers"]  # fmt: skip
        if not (values["use_sliding_window"] and per_layer):
            return
        fix = 'set "use_sliding_window": false (and no "sliding_attention" in layer_types)'
    else:
        fix = 'set "sliding_window": null'
    if window is not None and window < context:
        raise HFImportError(
            f"{where}: sliding_window={window} < max_position_embeddings={context}: expected full causal attention "
            f"(lmcore has no sliding window; the results differ past {window} tokens); fix: {fix} in config.json "
            f"to use full attention, the same result on inputs up to {window} tokens"
        )


def _biases(model_type: str, values: dict[str, Any], where: str) -> tuple[bool, bool]:
    """(ModelConfig.bias, ModelConfig.qkv_bias)."""
    if model_type == "qwen2":
        return False, True
    if model_type == "mistral":
        return False, False
    attention, mlp = bool(values["attention_bias"]), bool(values["mlp_bias"])
    if attention != mlp:
        raise HFImportError(
            f"{where}: attention_bias={attention}, mlp_bias={mlp}: expected both true or both false (lmcore's `bias` "
            "covers every projection); found biases on one of them only"
        )
    return attention, False


def _rope_fields(rope: dict[str, Any], max_positions: int, where: str, layout: str) -> dict[str, Any]:
    """The ModelConfig rope fields of one rope dict (with rope_type and rope_theta) read in `layout`."""
    rope_type = rope["rope_type"]
    if rope_type not in ROPE_TYPES:
        label = "rope_parameters.rope_type" if layout == "v5" else "rope_scaling.rope_type"
        raise HFImportError(
            f"{where}: {label}={rope_type!r}: expected one of {', '.join(ROPE_TYPES)}; found a rope scaling lmcore "
            "does not compute; fix: use a checkpoint without it (yarn, longrope and the others are not mapped)"
        )
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise HFImportError(f"{where}: partial_rotary_factor={partial}: expected 1.0 (every head dim rotated)")
    fields: dict[str, Any] = {
        "position": "rope",
        "rope_theta": float(_number(rope, "rope_theta", where, layout)),
        "rope_scaling": ROPE_TYPES[rope_type],
    }
    if rope_type in ("linear", "dynamic", "llama3"):
        fields["rope_factor"] = float(_number(rope, "factor", where, layout))
    if rope_type == "dynamic":
        fields["rope_original_context"] = max_positions  # transformers' dynamic NTK divides by max_position_embeddings
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(_number(rope, "low_freq_factor", where, layout))
        fields["rope_high_freq_factor"] = float(_number(rope, "high_freq_factor", where, layout))
        original = _number(rope, "original_max_position_embeddings", where, layout, max_positions)
        fields["rope_original_context"] = int(original)
    return fields


def hf_mismatches(config: ModelConfig, architecture: str) -> list[str]:
    """The fields of `config` that transformers' `architecture` cannot express, as "field=value (what it has)";
    empty when the model maps exactly.

    Example:
        >>> hf_mismatches(ModelConfig.from_preset("tiny"), "LlamaForCausalLM")[:2]
        ["position='alibi' (LlamaForCausalLM: rope)", "norm='layernorm' (LlamaForCausalLM: rmsnorm)"]
    """
    model_type = ARCHITECTURES[architecture]
    wanted: list[tuple[str, Any, str]] = [
        ("position", "rope", "rope"),
        ("norm", "rmsnorm", "rmsnorm"),
        ("activation", "swiglu", "swiglu"),
        ("document_separator", None, "attention across documents"),
    ]
    if model_type == "qwen2":
        wanted += [("bias", False, "no bias on o_proj and the MLP"), ("qkv_bias", True, "biases on q, k, v")]
    elif model_type == "mistral":
        wanted += [("bias", False, "no biases"), ("qkv_bias", False, "no biases")]
    elif config.qkv_bias and not config.bias:
        wanted += [("qkv_bias", False, "attention_bias covers o_proj too")]
    return [
        f"{name}={getattr(config, name)!r} ({architecture}: {has})"
        for name, want, has in wanted
        if getattr(config, name) != want
    ]


def hf_config(config: ModelConfig, architecture: str, layout: str = "v4", dtype: str = "float32") -> dict[str, Any]:
    """The config.json keys of `architecture` that `config` decides, in the rope `layout` ("v4": top-level rope_theta
    and rope_scaling; "v5": rope_parameters). ValueError when the model does not map (see `hf_mismatches`).

    Example:
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False)
        >>> hf = hf_config(cfg, "LlamaForCausalLM")
        >>> hf["architectures"], hf["num_key_value_heads"], hf["rope_theta"], hf["rope_scaling"]
        (['LlamaForCausalLM'], 4, 10000.0, None)
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: expected one of {', '.join(ARCHITECTURES)}")
    bad = hf_mismatches(config, architecture)
    if bad:
        raise ValueError(f"the model does not map onto transformers' {architecture}: {', '.join(bad)}")
    model_type = ARCHITECTURES[architecture]
    original = config.rope_original_context or config.context_length
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        # transformers' dynamic NTK scales past max_position_embeddings: it must be the original context.
        "max_position_embeddings": original if config.rope_scaling == "dynamic" else config.context_length,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
    }
    if model_type == "llama":
        out.update(attention_bias=config.bias, mlp_bias=config.bias, head_dim=config.head_dim)
    elif model_type == "mistral":
        out.update(sliding_window=None, head_dim=config.head_dim)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layer)
    scaling: dict[str, Any] = {}
    if config.rope_scaling != "none":
        scaling = {"rope_type": config.rope_scaling, "factor": config.rope_factor}
    if config.rope_scaling == "llama3":
        scaling.update(
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=original,
        )
    if layout == "v5":
        out["rope_parameters"] = {"rope_theta": config.rope_theta, "rope_type": "default", **scaling}
    elif layout == "v4":
        out.update(rope_theta=config.rope_theta, rope_scaling=scaling or None)
    else:
        raise ValueError(f"layout {layout!r}: expected 'v4' or 'v5'")
    return out


def rope_layout(config: dict[str, Any]) -> str:
    """ "v5" when a config.json dict holds `rope_parameters`, else "v4"."""
    return "v5" if config.get("rope_parameters") is not None else "v4"


def lmcore_name(hf_name: str) -> str | None:
    """lmcore's state_dict name for a Hugging Face tensor name of the family, or None when it has none.

    Example:
        >>> lmcore_name("model.layers.3.input_layernorm.weight"), lmcore_name("model.layers.0.self_attn.q_proj.bias")
        ('layers.3.attn_norm.weight', 'layers.0.self_attn.q_proj.bias')
    """
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    match = _HF_LAYER.fullmatch(hf_name)
    if not match:
        return None
    index, rest = match.groups()
    module, _, leaf = rest.partition(".")
    if module in LAYER_RENAMES:
        return f"layers.{index}.{LAYER_RENAMES[module]}.{leaf}"
    if module in ("self_attn", "mlp"):
        return f"layers.{index}.{rest}"
    return None


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of an lmcore state_dict name (the inverse of `lmcore_name`).

    Example:
        >>> hf_name("layers.1.mlp_norm.weight"), hf_name("embed_tokens.weight")
        ('model.layers.1.post_attention_layernorm.weight', 'model.embed_tokens.weight')
    """
    for theirs, ours in _TOP_LEVEL.items():
        if name == ours:
            return theirs
    match = _OUR_LAYER.fullmatch(name)
    if not match:
        raise ValueError(f"{name!r} has no Hugging Face name in the Llama family")
    index, rest = match.groups()
    module, _, leaf = rest.partition(".")
    for theirs, ours in LAYER_RENAMES.items():
        if module == ours:
            return f"model.layers.{index}.{theirs}.{leaf}"
    return f"model.layers.{index}.{rest}"
