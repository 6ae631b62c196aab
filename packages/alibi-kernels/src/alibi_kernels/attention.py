"""`alibi_attention` and `alibi_attention_varlen`: the public entry points, which check inputs and pick a backend."""

from __future__ import annotations

import importlib.util
import os

import torch

from alibi_kernels.attention_torch import torch_attention_checked, torch_varlen_checked
from alibi_kernels.validation import check_attention_inputs, check_document_starts, check_varlen_inputs

__all__ = ["alibi_attention", "alibi_attention_varlen", "BACKENDS", "resolve_backend", "triton_unavailable_reason"]

BACKENDS = ("auto", "triton", "torch")
# Looked up once: importlib's finder is not something torch.compile traces (torch 2.11 breaks the graph on it), and
# the answer does not change while a process runs.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device`, or None if it can.

    Example:
        >>> import torch
        >>> triton_unavailable_reason(torch.device("cuda"))  # None: CUDA tensors can use the kernels
        >>> triton_unavailable_reason(torch.device("mps"))
        "Triton kernels need CUDA tensors, got a tensor on mps; use backend='torch'"
    """
    if not TRITON_INSTALLED:
        return "the `triton` package is not installed (pip install triton; Linux only)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _interpreting():
            return None
        return (
            "Triton kernels need CUDA tensors; CPU tensors run only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing triton, slow, for tests) or use backend='torch'"
        )
    return f"Triton kernels need CUDA tensors, got a tensor on {device}; use backend='torch'"


def alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with ALiBi positions: softmax(q k^T * scale - slope_h * (pos_i - pos_j)) v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq % Hkv == 0 (GQA/MQA without copying k/v) and 16 <= D <= 256.
    Queries are aligned to the end of the keys (pos_i = i + Tk - Tq), so KV-cache decoding with Tq = 1 works;
    when causal, keys with pos_j > pos_i are masked (and Tq <= Tk is required). `slopes` is None
    (alibi_slopes(Hq)), (Hq,) or (B, Hq), float32/float64; gradients flow to q, k, v and to slopes that require
    grad. `softmax_scale` defaults to D**-0.5. `backend`: "triton" (CUDA, or CPU under TRITON_INTERPRET=1),
    "torch" (SDPA with a cached additive bias), "auto" (Triton on CUDA, else torch). Output: (B, Hq, Tq, D),
    q's dtype.

    `document_starts` (B, T) integers, for causal self-attention over rows of packed documents: query i of row b
    sees the keys j with document_starts[b, i] <= j <= i (the first token of its document up to itself), and
    ALiBi's distance i - j is the distance inside the document, so each document is attended as if alone. Its
    values are trusted (a start past its query is taken as the query itself). On the torch path it is one SDPA
    call over the batch with no host read; on the Triton path the rows are packed for the varlen kernels inside
    one custom operator, which reads the document offsets on the host (one device-to-host copy per call). A
    compiled graph keeps either whole.

    Example:
        >>> q = torch.randn(1, 4, 10, 32); k = v = torch.randn(1, 1, 10, 32)
        >>> alibi_attention(q, k, v).shape
        torch.Size([1, 4, 10, 32])
    """
    _check_backend_name(backend)
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    if document_starts is not None:
        check_document_starts(document_starts, shape, slopes_2d, causal, q.device)
    if resolve_backend(backend, q.device) == "torch":
        return torch_attention_checked(q, k, v, shape, slopes_2d, scale, causal, document_starts)
    from alibi_kernels.attention_triton import triton_attention_checked, triton_documents_checked

    if document_starts is None:
        return triton_attention_checked(q, k, v, slopes_2d, scale, causal)
    return triton_documents_checked(q, k, v, document_starts, slopes_2d, scale, causal)


def starts_to_offsets(document_starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows' documents as varlen offsets: (cu_seqlens int32 over the flattened B * T tokens, max_seqlen). One
    device-to-host copy (the number of documents and the longest).

    Example:
        >>> starts_to_offsets(torch.tensor([[0, 0, 2, 2], [0, 1, 1, 3]]))
        (tensor([0, 2, 4, 5, 7, 8], dtype=torch.int32), 2)
    """
    b, t = document_starts.shape
    index = torch.arange(t, device=document_starts.device)
    begins = (torch.minimum(document_starts, index) == index).flatten()  # a token whose document starts at itself
    begins[::t] = True  # every row starts a document
    offsets = torch.cat([begins.nonzero().squeeze(1), begins.new_tensor([b * t], dtype=torch.long)])
    return offsets.to(torch.int32), int(torch.diff(offsets).max())


def alibi_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """ALiBi self-attention over packed documents (flash-attn's varlen layout); positions restart in each document.

    q: (total_tokens, Hq, D); k, v: (total_tokens, Hkv, D), Hq % Hkv == 0, 16 <= D <= 256. Document i is rows
    cu_seqlens[i]:cu_seqlens[i+1] of q, k and v; `cu_seqlens` is a 1-D int32/int64 tensor on q's device that starts
    at 0, never decreases (empty documents allowed) and ends at total_tokens. No query attends across a document
    boundary; inside a document the bias is -slope_h * (pos_i - pos_j) with positions from 0, causal by default (the
    same formula as `alibi_attention`, signed when not causal). `max_seqlen` (the longest document) is computed when
    None; a given value must be at least the longest document. `slopes`: None (alibi_slopes(Hq)) or (Hq,)
    float32/float64, shared by all documents; gradients reach q, k, v and slopes that require grad. `backend` as in
    `alibi_attention`. Output: (total_tokens, Hq, D), q's dtype. cu_seqlens is read on the host and checked once
    per call, except on the Triton path with `max_seqlen` given: there its values are trusted, as flash-attn does, so
    the call makes no device-to-host copy (compute max_seqlen once and reuse it across layers).

    Example:
        >>> q = torch.randn(30, 4, 32); k = v = torch.randn(30, 2, 32)
        >>> alibi_attention_varlen(q, k, v, torch.tensor([0, 10, 10, 30])).shape  # documents of 10, 0, 20 tokens
        torch.Size([30, 4, 32])
    """
    _check_backend_name(backend)
    on_triton = isinstance(q, torch.Tensor) and resolve_backend(backend, q.device) == "triton"
    read_offsets = max_seqlen is None or not on_triton
    shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, slopes, softmax_scale, read_offsets)
    if not on_triton:
        return torch_varlen_checked(q, k, v, shape, slopes_2d, scale, causal)
    from alibi_kernels.attention_triton import triton_varlen_checked

    return triton_varlen_checked(q, k, v, cu_seqlens, shape.max_seqlen, slopes_2d, scale, causal)


def _check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend a call with `backend` ("auto", "triton" or "torch") runs on `device`: "torch" or "triton";
    RuntimeError saying why when "triton" was asked for and cannot run.

    Example:
        >>> resolve_backend("auto", torch.device("cpu"))
        'torch'
    """
    if backend == "auto":
        use_triton = device.type == "cuda" and triton_unavailable_reason(device) is None
        return "triton" if use_triton else "torch"
    if backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run here: {reason}")
    return backend
