"""Fused causal attention with ALiBi positions: Triton kernels (forward and backward) and a plain-PyTorch path.

Padded batches (B, H, T, D) go through `alibi_attention` (rows of packed documents too, with `document_starts`);
packed documents (total, H, D) with flash-attn-style `cu_seqlens` through `alibi_attention_varlen`.

Example:
    >>> import torch
    >>> from alibi_kernels import alibi_attention, alibi_slopes
    >>> q = torch.randn(2, 8, 64, 32); k = v = torch.randn(2, 8, 64, 32)
    >>> out = alibi_attention(q, k, v, alibi_slopes(8))  # causal by default
    >>> out.shape
    torch.Size([2, 8, 64, 32])
    >>> from alibi_kernels import alibi_attention_reference  # the plain float64 formula
    >>> torch.allclose(out.double(), alibi_attention_reference(q, k, v, alibi_slopes(8)), atol=1e-5)
    True
    >>> from alibi_kernels import launch_configs  # which Triton tiles an RTX 3090 can launch, decided without a GPU
    >>> launch_configs("dkdv", capability=(8, 6), smem_per_block=101376, dtype=torch.float32, head_dim=128)[0]
    TileConfig(block_m=16, block_n=64, num_warps=8, num_stages=2)
"""

from alibi_kernels.attention import (
    BACKENDS,
    alibi_attention,
    alibi_attention_varlen,
    resolve_backend,
    triton_unavailable_reason,
)
from alibi_kernels.attention_torch import alibi_attention_torch, bias_cache_info, clear_bias_cache
from alibi_kernels.launch_configs import GPU_TARGETS, LaunchConfigError, TileConfig, candidate_configs, launch_configs
from alibi_kernels.reference import alibi_attention_reference, alibi_attention_varlen_reference, alibi_bias
from alibi_kernels.slopes import alibi_slopes, alibi_slopes_list
from alibi_kernels.version import __version__

__all__ = [
    "BACKENDS",
    "GPU_TARGETS",
    "LaunchConfigError",
    "TileConfig",
    "__version__",
    "alibi_attention",
    "alibi_attention_reference",
    "alibi_attention_torch",
    "alibi_attention_varlen",
    "alibi_attention_varlen_reference",
    "alibi_bias",
    "alibi_slopes",
    "alibi_slopes_list",
    "bias_cache_info",
    "candidate_configs",
    "clear_bias_cache",
    "launch_configs",
    "resolve_backend",
    "triton_unavailable_reason",
]
