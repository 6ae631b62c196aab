"""Rotary position embeddings as transformers computes them for the Llama family (Llama, Qwen2, Mistral).

The layout is transformers' `rotate_half`: a head's first half of dimensions pairs with its second half (not
interleaved pairs), cos and sin are `cat(freqs, freqs)`. The inverse frequencies of each `rope_type` repeat
transformers' `modeling_rope_utils` operation by operation in the same dtypes (float32 tensors, Python floats
where they use Python floats), so the rotated queries and keys are bitwise what transformers builds:

- "none" ("default"): 1 / theta^(2i / D);
- "linear": the same divided by `factor`;
- "dynamic" (NTK): past `original` positions, theta * (factor * L / original - (factor - 1))^(D / (D - 2)) with L
  the sequence length; transformers takes L = max(position) + 1 of the call and keeps the largest L it has seen
  until a call falls back under `original`; here each call uses its own L (the same in one forward, and in a
  generation that only grows);
- "llama3": wavelengths above original / low_freq_factor divided by `factor`, below original / high_freq_factor
  kept, smoothly interpolated in between.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lmcore.config import ModelConfig
from lmcore.documents import document_starts


def _default_inv_freq(base: float | Tensor, dim: int, device: torch.device | None) -> Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # (D/2,)
    return 1.0 / (base**exponent)


def inv_freq(config: ModelConfig, seq_len: int | None = None, device: torch.device | None = None) -> Tensor:
    """The (head_dim / 2,) float32 inverse frequencies of `config`'s rotary embedding for a sequence of `seq_len`
    positions (only "dynamic" scaling depends on it).

    Example:
        >>> cfg = ModelConfig.from_preset("tiny", position="rope", rope_scaling="linear", rope_factor=2.0)
        >>> inv_freq(cfg)[:3]
        tensor([0.5000, 0.1581, 0.0500])
    """
    dim, base = config.head_dim, float(config.rope_theta)
    original = config.rope_original_context or config.context_length
    scaling = config.rope_scaling
    if scaling == "linear":
        return _default_inv_freq(base, dim, device) / config.rope_factor
    if scaling == "dynamic":
        factor, exponent = config.rope_factor, dim / (dim - 2)
        if seq_len is not None and seq_len > original:
            # transformers takes L as a 0-d int64 tensor here, so the new base is a float32 tensor.
            length = torch.tensor(seq_len, dtype=torch.int64, device=device)
            return _default_inv_freq(base * ((factor * length / original) - (factor - 1)) ** exponent, dim, device)
        # Up to `original` positions, transformers' initial frequencies: L = original, in Python floats.
        return _default_inv_freq(base * ((factor * original / original) - (factor - 1)) ** exponent, dim, device)
    freqs = _default_inv_freq(base, dim, device)
    if scaling != "llama3":
        return freqs
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def positions_in_documents(input_ids: Tensor, separator: int) -> Tensor:
    """(B, T) int64 positions that restart at 0 after every `separator` token (the separator closes its document,
    as `lmcore.documents` cuts them); vectorised, no host sync.

    Example:
        >>> positions_in_documents(torch.tensor([[5, 2, 7, 8], [2, 3, 2, 4]]), separator=2)
        tensor([[0, 1, 0, 1],
                [0, 0, 1, 0]])
    """
    return torch.arange(input_ids.shape[1], device=input_ids.device) - document_starts(input_ids, separator)


def rotary_cos_sin(config: ModelConfig, positions: Tensor, seq_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, head_dim) for the integer `positions`, in `dtype` (transformers
    computes them in float32 and casts to the hidden states' dtype); `seq_len` feeds "dynamic" scaling.

    Example:
        >>> cfg = ModelConfig.from_preset("tiny", position="rope")
        >>> cos, sin = rotary_cos_sin(cfg, torch.arange(5)[None], 5, torch.float32)
        >>> cos.shape, float(cos[0, 0, 0]), float(sin[0, 0, 0])  # position 0: no rotation
        (torch.Size([1, 5, 16]), 1.0, 0.0)
    """
    freqs = positions[..., None].float() * inv_freq(config, seq_len, positions.device)  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) or (N, H, D) by cos/sin (B, T, D) or (N, D), one angle per token shared by its heads;
    the result keeps x's dtype (cos/sin in float32 would otherwise promote a bf16 x under autocast).

    Example:
        >>> x = torch.randn(1, 3, 2, 4)
        >>> cos, sin = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)  # angle 0
        >>> torch.equal(apply_rope(x, cos, sin), x)
        True
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads axis
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
