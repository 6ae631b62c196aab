"""The torch path: PyTorch SDPA with an additive ALiBi bias, cached per shape, chunked over queries for long T.

GQA/MQA never copies k/v: the Hq = Hkv * G query heads are folded into the query axis,
q (B, Hq, Tq, D) -> (B, Hkv, G * Tq, D), so each k/v head is attended by its G query heads in one SDPA call
(works on every torch version and every SDPA backend, unlike `enable_gqa`, which needs torch >= 2.5).
Packed documents (`cu_seqlens`) loop over the documents, each a (1, H, T_doc, D) view of the packed tensors;
documents given as `document_starts` (B, T) stay in the batch layout, one SDPA call whose bias masks the keys
before each query's document, with no host read (what a compiled graph needs).

No host read per call: the bias cache is keyed by the slopes' values, read once per slopes tensor and version
(an identity key: storage, layout, version counter), so equal slopes (every layer of a model) share one bias and
a step reads nothing. Under `torch.compile` the bias is built inside the graph instead, which then has no break.
With fp32 GEMMs routed to oneDNN (`torch.backends.mkldnn.matmul.fp32_precision` other than "none" or "ieee"),
SDPA runs with the setting at "ieee", forward and backward: its flash kernel's many small GEMMs are several
times slower through oneDNN (lmcore's docs/benchmarks.md section on the training step).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F

from alibi_kernels.validation import AttentionShape, VarlenShape, check_attention_inputs, check_document_starts

__all__ = [
    "alibi_attention_torch",
    "torch_attention_checked",
    "torch_varlen_checked",
    "bias_cache_info",
    "clear_bias_cache",
    "MAX_BIAS_ELEMENTS",
]

# A bias larger than this many elements (16 MiB in fp32) is not cached: queries are processed in chunks whose
# bias stays below it, so memory grows as O(T) per chunk row instead of O(T^2).
MAX_BIAS_ELEMENTS = 1 << 22
_CACHE_MAX_ENTRIES = 16


class _BiasCache:
    """A small thread-safe LRU cache of bias tensors keyed by (Tq, Tk, slopes, causal, dtype, device)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, build) -> torch.Tensor:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
        bias = build()
        with self._lock:
            self.misses += 1
            self._entries[key] = bias
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return bias

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


_CACHE = _BiasCache(_CACHE_MAX_ENTRIES)


class _SlopeValues:
    """The Python values of slopes tensors, read on the host once per tensor and version, kept in a small LRU.

    Keyed by identity: device, storage address, offset, shape, stride, dtype and the version counter (bumped by
    every in-place write, `no_grad` ones included). Each entry holds its tensor, so the storage cannot be freed
    and its address reused by other values while the entry lives. A write through `.data` bypasses the version
    counter and is not seen (call `clear_bias_cache()` after one). Inference tensors have no version counter:
    their values are read on every call.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, tuple[float, ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, slopes: torch.Tensor) -> tuple[float, ...]:
        if slopes.is_inference():
            return tuple(slopes.flatten().tolist())
        key = (
            str(slopes.device),
            slopes.untyped_storage().data_ptr(),
            slopes.storage_offset(),
            tuple(slopes.shape),
            slopes.stride(),
            slopes.dtype,
            slopes._version,
        )
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][1]
        values = tuple(slopes.detach().flatten().tolist())  # the one host read for this tensor and version
        with self._lock:
            self._entries[key] = (slopes, values)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return values

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# Several models' layers, each with its own slopes buffer, fit before one is read again.
_SLOPE_VALUES = _SlopeValues(256)


def bias_cache_info() -> dict[str, int]:
    """Hits, misses and size of the torch path's bias cache (for tests and tuning).

    Example:
        >>> sorted(bias_cache_info())
        ['hits', 'max_entries', 'misses', 'size']
    """
    return {
        "hits": _CACHE.hits,
        "misses": _CACHE.misses,
        "size": len(_CACHE._entries),
        "max_entries": _CACHE.max_entries,
    }


def clear_bias_cache() -> None:
    """Drop every cached bias tensor (they may hold GPU memory) and the slopes' values read so far."""
    _CACHE.clear()
    _SLOPE_VALUES.clear()


_MATMUL = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # in torch 2.13, not in its stubs
# fp32_precision values that keep fp32 GEMMs on the BLAS library (MKL), not oneDNN.
_UNROUTED = ("none", "ieee")


def _set_matmul_precision(value: str) -> None:
    _MATMUL.fp32_precision = value


@contextlib.contextmanager
def _unrouted_gemms(device: torch.device):
    """fp32 GEMMs on the BLAS library inside the block, whatever `fp32_precision` routes elsewhere (CPU, eager)."""
    saved = _MATMUL.fp32_precision if device.type == "cpu" and not torch.compiler.is_compiling() else "none"
    if saved in _UNROUTED:
        yield
        return
    _set_matmul_precision("ieee")
    try:
        yield
    finally:
        _set_matmul_precision(saved)


def _unrouted_backward(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    """Run the backward of `out` back to the grads of `inputs` with fp32 GEMMs on the BLAS library, as the forward
    ran: from a pre-hook on the node that made `out` until a hook that fires once all of `inputs`' grads are in (the
    math path with a bias that needs a gradient is several nodes)."""
    if torch.compiler.is_compiling() or out.device.type != "cpu" or out.grad_fn is None:
        return
    saved = _MATMUL.fp32_precision
    if saved in _UNROUTED:
        return
    out.grad_fn.register_prehook(lambda grad_outputs: _set_matmul_precision("ieee"))
    needing = [t for t in inputs if t.requires_grad]
    torch.autograd.graph.register_multi_grad_hook(needing, lambda grads: _set_matmul_precision(saved))


def _bias_block(
    slopes_2d: torch.Tensor, row_pos0: int, n_rows: int, n_keys: int, causal: bool, dtype: torch.dtype
) -> torch.Tensor:
    """-slope * (pos_i - pos_j) for rows at positions row_pos0.. and keys 0..n_keys-1: (S, Hq, n_rows, n_keys).

    Built in float32 (float64 for float64) and rounded to `dtype` once: a distance cast to bf16 is no longer an
    exact integer above 256 (fp16: 2048), and a product taken in bf16 rounds a second time.
    """
    device = slopes_2d.device
    build = torch.float64 if dtype == torch.float64 else torch.float32
    pos_i = torch.arange(row_pos0, row_pos0 + n_rows, device=device)
    pos_j = torch.arange(n_keys, device=device)
    distance = (pos_j[None, :] - pos_i[:, None]).to(build)  # (rows, keys), exact integers below 2^24
    bias = slopes_2d.to(build)[:, :, None, None] * distance
    if causal:
        bias = bias.masked_fill(distance > 0, float("-inf"))
    return bias.to(dtype)


def _hide_other_documents(
    bias: torch.Tensor, document_starts: torch.Tensor, row0: int, n_rows: int, n_keys: int
) -> torch.Tensor:
    """The grouped bias (1, Hkv, G*R, K) of query rows row0.. with -inf on the keys before each row's document:
    (B, Hkv, G*R, K). Built from tensor ops alone (no host read), so a compiled graph keeps it."""
    s, kv_heads, grouped_rows, k = bias.shape
    device = bias.device
    rows = torch.arange(row0, row0 + n_rows, device=device)
    # A start past its own query would hide every key (a NaN row): clamp, as no document starts after its tokens.
    starts = torch.minimum(document_starts[:, row0 : row0 + n_rows].to(rows.dtype), rows)  # (B, R)
    hidden = torch.arange(n_keys, device=device)[None, None, :] < starts[:, :, None]  # (B, R, K)
    per_group = bias.view(s, kv_heads, grouped_rows // n_rows, n_rows, k)  # (1, Hkv, G, R, K)
    masked = per_group.masked_fill(hidden[:, None, None], float("-inf"))  # (B, Hkv, G, R, K)
    return masked.reshape(document_starts.shape[0], kv_heads, grouped_rows, k)


def _grouped(bias: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # (S, Hq, R, K) -> (S, Hkv, G * R, K): query head h = hkv * G + g, matching the folded q layout.
    s, hq, r, k = bias.shape
    return bias.reshape(s, kv_heads, (hq // kv_heads) * r, k)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    # CPU half-precision matmuls are slow and round the bias; fp32 there is both faster and closer to float64.
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return q.dtype


def _attend(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, shape: AttentionShape, scale):
    """SDPA of q rows (B, Hq, R, D) against k/v (B, Hkv, K, D) with bias (S, Hkv, G*R, K) -> (B, Hq, R, D)."""
    b, hq, r, d = q_rows.shape
    q_folded = q_rows.reshape(b, shape.kv_heads, shape.group * r, d)  # (B, Hkv, G*R, D)
    # CPU autocast would cast the fp32 compute copies back to bf16; the compute dtype was chosen on purpose.
    with (
        torch.autocast("cpu", enabled=False) if q_rows.device.type == "cpu" else contextlib.nullcontext(),
        _unrouted_gemms(q_rows.device),
    ):
        out = F.scaled_dot_product_attention(q_folded, k, v, attn_mask=bias, scale=scale)
    _unrouted_backward(out, (q_folded, k, v, bias))
    return out.reshape(b, hq, r, d)


def alibi_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """ALiBi attention on the torch path (any device). Same contract as `alibi_attention(..., backend="torch")`.

    Example:
        >>> q = torch.randn(2, 4, 8, 16); kv = torch.randn(2, 2, 8, 16)
        >>> alibi_attention_torch(q, kv, kv).shape
        torch.Size([2, 4, 8, 16])
    """
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    if document_starts is not None:
        check_document_starts(document_starts, shape, slopes_2d, causal, q.device)
    return torch_attention_checked(q, k, v, shape, slopes_2d, scale, causal, document_starts)


def torch_attention_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape: AttentionShape,
    slopes_2d: torch.Tensor,
    scale: float,
    causal: bool,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch path on inputs `check_attention_inputs` already validated (the dispatcher checks once); with
    `document_starts` (B, T), checked by `check_document_starts`, keys before each query's document are masked."""
    dtype = _compute_dtype(q)
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    n_slope_rows = slopes_2d.shape[0]
    tq, tk, off = shape.q_len, shape.k_len, shape.offset
    mask_rows = n_slope_rows if document_starts is None else shape.batch  # documents give every row its own mask

    if mask_rows * shape.q_heads * tq * tk <= MAX_BIAS_ELEMENTS:

        def build() -> torch.Tensor:
            return _grouped(_bias_block(slopes_2d, off, tq, tk, causal, dtype), shape.kv_heads)

        if slopes_2d.requires_grad or torch.compiler.is_compiling():
            # Rebuilt every call: so the gradient reaches the slopes; in a compiled graph, where the compiler folds
            # it into the kernels and a Python cache would break the graph.
            bias = build()
        else:
            key = (tq, tk, shape.kv_heads, causal, dtype, str(q.device), slopes_2d.shape, _SLOPE_VALUES.get(slopes_2d))
            bias = _CACHE.get(key, build)
        if document_starts is not None:
            bias = _hide_other_documents(bias, document_starts, 0, tq, tk)
        return _attend(qc, kc, vc, bias, shape, scale).to(q.dtype)

    # Long sequences: query chunks, each against only the keys it can see (causal) with its own small bias.
    rows = max(1, MAX_BIAS_ELEMENTS // (mask_rows * shape.q_heads * tk))
    outs = []
    for start in range(0, tq, rows):
        stop = min(tq, start + rows)
        n_keys = min(tk, stop + off) if causal else tk
        bias = _grouped(_bias_block(slopes_2d, start + off, stop - start, n_keys, causal, dtype), shape.kv_heads)
        if document_starts is not None:
            bias = _hide_other_documents(bias, document_starts, start, stop - start, n_keys)
        outs.append(_attend(qc[:, :, start:stop], kc[:, :, :n_keys], vc[:, :, :n_keys], bias, shape, scale))
    return torch.cat(outs, dim=2).to(q.dtype)  # (B, Hq, Tq, D)


def torch_varlen_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape: VarlenShape,
    slopes_2d: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Packed documents on the torch path, inputs already checked by `check_varlen_inputs`: (total, Hq, D).

    One torch-path call per non-empty document on (1, H, T_doc, D) views (no copies of the packed tensors); the
    bias cache then holds one entry per distinct document length.
    """
    outs = []
    for start, stop in shape.documents():
        n = stop - start
        if n == 0:
            continue
        doc = AttentionShape(1, shape.q_heads, shape.kv_heads, n, n, shape.head_dim)
        q_doc, k_doc, v_doc = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T_doc, D)
        out = torch_attention_checked(q_doc, k_doc, v_doc, doc, slopes_2d, scale, causal)
        outs.append(out[0].transpose(0, 1))  # (T_doc, Hq, D)
    if not outs:  # every document is empty, so total_tokens is 0
        return q[:0].clone()
    return torch.cat(outs)  # (total, Hq, D)
