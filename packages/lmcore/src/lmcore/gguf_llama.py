"""A Llama-family lmcore model as a GGUF file of llama.cpp's "llama" (Llama, Mistral) or "qwen2" architecture.

Written as llama.cpp's own converter (convert_hf_to_gguf.py) writes these architectures from a Hugging Face
directory: tensor names `token_embd`, `blk.N.attn_norm`, `attn_q/k/v` (with their biases for Qwen2),
`attn_output`, `ffn_norm`, `ffn_gate/up/down`, `output_norm` and `output` (left out when tied); keys for the
sizes, `rope.freq_base`, `attention.layer_norm_rms_eps`, linear rope scaling as `rope.scaling.type/factor`, and
Llama 3's scaling as a `rope_freqs.weight` tensor of per-frequency divisors.

llama.cpp's "llama" graph rotates adjacent pairs of a head's dimensions, transformers' Llama rotates the first half
against the second (`rotate_half`): the converter permutes the rows of q and k (weights and biases) within each head
so that the two agree, and so does this writer. "qwen2" rotates halves as transformers does (llama.cpp's NEOX
mode): no permutation. Dynamic NTK scaling has no GGUF equivalent and is refused, as is Llama 3's on "qwen2".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmcore.config import ModelConfig
from lmcore.extras import import_extra
from lmcore.gguf_mpt import GGUFVocab, add_vocab, open_writer, write_tensors
from lmcore.hf_llama import hf_mismatches

if TYPE_CHECKING:
    from lmcore.model import GPT

# Hugging Face architecture -> llama.cpp architecture.
GGUF_ARCHES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# lmcore module inside a block -> GGUF tensor.
BLOCK_TENSORS = {
    "attn_norm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp_norm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_llama_mismatches(config: ModelConfig, architecture: str) -> list[str]:
    """What of `config` llama.cpp's architecture for `architecture` cannot express, as "field=value (what it has)".

    Example:
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False,
        ...                               rope_scaling="dynamic", rope_factor=2.0)
        >>> gguf_llama_mismatches(cfg, "LlamaForCausalLM")
        ["rope_scaling='dynamic' (GGUF llama: none, linear or llama3)"]
    """
    arch = GGUF_ARCHES[architecture]
    bad = hf_mismatches(config, architecture)
    allowed = ("none", "linear", "llama3") if arch == "llama" else ("none", "linear")
    if config.rope_scaling not in allowed:
        bad.append(f"rope_scaling={config.rope_scaling!r} (GGUF {arch}: {', '.join(allowed[:-1])} or {allowed[-1]})")
    return bad


def permute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection (weight (H * D, in) or bias (H * D,)) reordered within each head from
    transformers' half-split rotary layout to llama.cpp's interleaved one: row i of the second half goes next to
    row i of the first.

    Example:
        >>> permute_rotary(torch.arange(8.0), n_head=2)  # two heads of 4: (0, 1 | 2, 3) -> (0, 2, 1, 3)
        tensor([0., 2., 1., 3., 4., 6., 5., 7.])
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(config: ModelConfig) -> torch.Tensor:
    """(head_dim / 2,) float32 divisors of the rotary frequencies for Llama 3's scaling, the `rope_freqs.weight`
    llama.cpp reads: 1 for short wavelengths, `rope_factor` for long ones, the smooth blend in between."""
    dim, original = config.head_dim, config.rope_original_context or config.context_length
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs:  # 0-d float32 tensors, so the arithmetic rounds as llama.cpp's converter's does
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(factors, dtype=torch.float32)


def gguf_llama_tensors(model: GPT, architecture: str) -> dict[str, torch.Tensor]:
    """The weights of `model` under llama.cpp's names for `architecture`, float32 on the CPU, q and k permuted for
    "llama" (see the module docstring).

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False,
        ...                               n_kv_head=2)
        >>> tensors = gguf_llama_tensors(GPT(cfg), "LlamaForCausalLM")
        >>> tuple(tensors["blk.0.attn_k.weight"].shape), "output.weight" in tensors  # GQA; tied head not stored
        ((32, 64), False)
    """
    from lmcore.lora import lora_modules

    if lora_modules(model):
        raise ValueError("the model has LoRA adapters: merge them first (lmcore.merge_lora)")
    config, arch = model.config, GGUF_ARCHES[architecture]
    assert config.n_kv_head is not None  # __post_init__ replaces None by n_head
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["embed_tokens.weight"], "output_norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    if config.rope_scaling == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    heads = {"self_attn.q_proj": config.n_head, "self_attn.k_proj": config.n_kv_head}
    for i in range(config.n_layer):
        for ours, theirs in BLOCK_TENSORS.items():
            for kind in ("weight", "bias"):
                tensor = state.get(f"layers.{i}.{ours}.{kind}")
                if tensor is None:
                    continue
                if arch == "llama" and ours in heads:
                    tensor = permute_rotary(tensor, heads[ours])
                out[f"blk.{i}.{theirs}.{kind}"] = tensor
    return out


def write_gguf_llama(
    model: GPT,
    path: str | os.PathLike[str],
    vocab: GGUFVocab,
    *,
    architecture: str | None = None,
    dtype: str = "f32",
    name: str | None = None,
) -> None:
    """Write `model` and `vocab` to `path` as a GGUF file of llama.cpp's "llama" or "qwen2" architecture
    (`architecture` is the Hugging Face one, by default `lmcore.hf_export.default_architecture(model)`), in
    `dtype` ("f32" or "f16"). ValueError naming the fields when the model does not map.

    Example (needs the gguf extra):
        >>> import tempfile, gguf
        >>> from lmcore import GPT, ModelConfig
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", norm="rmsnorm", activation="swiglu", bias=False,
        ...                               qkv_bias=True)
        >>> vocab = GGUFVocab([f"t{i}" for i in range(97)], [], [1] * 97, eos_id=2, model="gpt2")
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_gguf_llama(GPT(cfg), f"{d}/m.gguf", vocab)
        ...     reader = gguf.GGUFReader(f"{d}/m.gguf")
        ...     reader.get_field("general.architecture").contents(), reader.get_field("qwen2.block_count").contents()
        ('qwen2', 2)
    """
    from lmcore.hf_export import default_architecture

    gguf = import_extra("gguf", "gguf", "the GGUF export")
    config = model.config
    architecture = architecture or default_architecture(model)
    if architecture not in GGUF_ARCHES:
        raise ValueError(f"architecture {architecture!r}: expected one of {', '.join(GGUF_ARCHES)}")
    arch = GGUF_ARCHES[architecture]
    bad = gguf_llama_mismatches(config, architecture)
    if bad:
        raise ValueError(f"the model does not map onto llama.cpp's {arch}: {', '.join(bad)}")
    writer = open_writer(gguf, path, arch, vocab, config.vocab_size, dtype=dtype, name=name)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    if config.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_factor)
    add_vocab(writer, vocab)
    write_tensors(writer, gguf_llama_tensors(model, architecture), dtype, path)


def bpe_vocab(directory: str | os.PathLike[str], *, pre: str = "default") -> GGUFVocab:
    """The byte-level BPE vocabulary of a Hugging Face model directory (its tokenizer.json, and the special token
    ids from tokenizer_config.json and config.json) as a GGUFVocab of llama.cpp's "gpt2" tokenizer; `pre` is
    llama.cpp's name for the pre-tokenizer (its converter recognises it by hashing tokenizer outputs: "smollm" for
    SmolLM2, "qwen2" for Qwen2). Read as JSON, no tokenizer library needed; ValueError naming the file otherwise.
    """
    directory = Path(directory)
    path = directory / "tokenizer.json"
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
        model = tokenizer["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a readable tokenizer.json ({exc}); expected Hugging Face tokenizers' file"
        ) from None
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model.type={model.get('type')!r}: expected 'BPE' (a byte-level BPE)")
    by_id = {int(i): token for token, i in model["vocab"].items()}
    types = {}
    for added in tokenizer.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = 3 if added.get("special") else 4  # control, user-defined
    size = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    settings = {}
    for name in ("config.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            settings.update(json.loads((directory / name).read_text(encoding="utf-8")))
    ids = {token: i for i, token in enumerate(tokens)}

    def token_id(key: str) -> int | None:
        value = settings.get(f"{key}_token_id")
        token = settings.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        return value if isinstance(value, int) else ids.get(token) if isinstance(token, str) else None

    eos = token_id("eos")
    if eos is None:
        raise ValueError(f"{directory}: no eos_token or eos_token_id in config.json or tokenizer_config.json")
    return GGUFVocab(
        tokens=tokens,
        scores=[],
        types=[types.get(i, 1) for i in range(size)],
        eos_id=eos,
        bos_id=token_id("bos"),
        unk_id=token_id("unk"),
        pad_id=token_id("pad"),
        add_bos=bool(settings.get("add_bos_token", False)),
        model="gpt2",
        pre=pre,
        merges=merges,
    )
