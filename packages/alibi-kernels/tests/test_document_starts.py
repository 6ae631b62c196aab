"""`alibi_attention(..., document_starts=...)`: rows of packed documents in the batch layout, against the float64
per-document reference of the same tokens packed for varlen; the torch path with no host read, the Triton path
through varlen under the interpreter; both one compiled graph.

Rows of 48 tokens: [5, 11, 32] (a tail crossing the interpreter's 32-row tile), [48] (one document), [1, 1, 46]
(one-token documents).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import FP32_GRAD_RTOL, NEEDS_INTERPRETER, assert_fp32_close, forward_backward
from test_attention_varlen import NAMES, make_packed, reference_varlen

import alibi_kernels.attention_torch as attention_torch
from alibi_kernels import alibi_attention, alibi_attention_varlen
from alibi_kernels.attention import starts_to_offsets

ROWS = [[5, 11, 32], [48], [1, 1, 46]]
T = 48


def starts_of(rows) -> torch.Tensor:
    """(B, T) int64: the first token of each token's document, from the document lengths of each row."""
    out = []
    for lengths in rows:
        first = [0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()]
        out.append([start for start, n in zip(first, lengths, strict=True) for _ in range(n)])
    return torch.tensor(out)


def batched(t: torch.Tensor) -> torch.Tensor:
    """Packed (B * T, H, D) -> (B, H, T, D), the same tokens row after row."""
    return t.reshape(-1, T, *t.shape[1:]).transpose(1, 2)


def check(backend, hq, hkv, d=16, slopes_grad=True):
    q, k, v, do, slopes, cu = make_packed([n for r in ROWS for n in r], hq, hkv, d)
    starts = starts_of(ROWS)

    def fn(q, k, v, s, *, causal):
        return alibi_attention(q, k, v, s, causal=causal, backend=backend, document_starts=starts)

    out, grads = forward_backward(fn, *map(batched, (q, k, v, do)), slopes, causal=True, slopes_grad=slopes_grad)
    ref_out, ref_grads = reference_varlen(q, k, v, do, slopes, cu, causal=True, slopes_grad=slopes_grad)
    assert_fp32_close("out", out, batched(ref_out))
    for name, g, r in zip(NAMES, grads, ref_grads, strict=False):
        assert_fp32_close(name, g, r if name == "dslopes" else batched(r), rtol=FP32_GRAD_RTOL)


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_torch_path_attends_each_document_alone(hq, hkv):
    check("torch", hq, hkv)


def test_torch_path_in_query_chunks_gives_the_same_figures(monkeypatch):
    # A bias above MAX_BIAS_ELEMENTS is built per chunk of query rows: 3 rows x 2 heads x 48 keys per chunk here.
    monkeypatch.setattr(attention_torch, "MAX_BIAS_ELEMENTS", 3 * 2 * 2 * T)
    check("torch", 2, 2)


@pytest.mark.parametrize("hq", [pytest.param(h, marks=NEEDS_INTERPRETER, id=i) for h, i in ((2, "mha"), (4, "gqa"))])
def test_triton_path_repacks_for_varlen(hq):
    check("triton", hq, 2, slopes_grad=False)


BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_INTERPRETER)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
def test_each_path_is_one_graph_forward_and_backward(backend, documents):
    """fullgraph=True (a graph break is an error) and aot_eager, which traces the backward as well: one graph, and
    the output and every gradient (slopes' included) equal to eager's. The Triton path is one custom operator per
    direction, so dynamo never traces its launch code or its host read of the document offsets."""
    q, k, v, do, slopes, _ = make_packed([n for r in ROWS for n in r], 2, 2, 16)
    starts = starts_of(ROWS) if documents else None

    def attend(q, k, v, s):
        return alibi_attention(q, k, v, s, backend=backend, document_starts=starts)

    results = []
    for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True)):
        inputs = [x.detach().requires_grad_() for x in (*map(batched, (q, k, v)), slopes)]
        out = fn(*inputs)
        out.backward(batched(do))
        results.append([out.detach(), *(x.grad for x in inputs)])
    torch._dynamo.reset()
    for name, got, expected in zip(["out", *NAMES], results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    inputs = (*map(batched, (q, k, v)), slopes)
    explained = torch._dynamo.explain(attend)(*inputs)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_given_max_seqlen_are_one_graph(backend):
    """`alibi_attention_varlen` with max_seqlen given: on the Triton path the same operators, so no host read and
    one graph, forward and backward (the torch path reads cu_seqlens on the host, a break there by design)."""
    lengths = [n for r in ROWS for n in r]
    q, k, v, do, slopes, cu = make_packed(lengths, 4, 2, 16)

    def attend(q, k, v, s):
        return alibi_attention_varlen(q, k, v, cu, max(lengths), s, backend=backend)

    results = []
    for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=backend == "triton")):
        inputs = [x.detach().requires_grad_() for x in (q, k, v, slopes)]
        out = fn(*inputs)
        out.backward(do)
        results.append([out.detach(), *(x.grad for x in inputs)])
    torch._dynamo.reset()
    for name, got, expected in zip(["out", *NAMES], results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    if backend == "triton":
        explained = torch._dynamo.explain(attend)(q, k, v, slopes)
        torch._dynamo.reset()
        breaks = [b.reason for b in explained.break_reasons]
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), breaks


def test_a_start_past_its_query_is_the_query_itself():
    q, k, v, _, slopes, _ = make_packed([T], 2, 2, 16)
    q, k, v = map(batched, (q, k, v))
    starts = torch.full((1, T), 10)
    expected = torch.minimum(starts, torch.arange(T))
    out = alibi_attention(q, k, v, slopes, backend="torch", document_starts=starts)
    assert not out.isnan().any()
    torch.testing.assert_close(out, alibi_attention(q, k, v, slopes, backend="torch", document_starts=expected))


def test_offsets_for_varlen_are_the_rows_documents():
    cu, longest = starts_to_offsets(starts_of(ROWS))
    assert cu.tolist() == [0, 5, 16, 48, 96, 97, 98, 144] and longest == 48


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"document_starts": torch.zeros(1, T, dtype=torch.long)}, r"must be a \(B, T\)=\(2, 48\) integer tensor"),
        ({"document_starts": torch.zeros(2, T)}, "integer tensor, got shape .* dtype torch.float32"),
        ({"causal": False}, r"needs causal self-attention \(causal=True, Tq == Tk\), got causal=False"),
        ({"q_len": 8, "document_starts": torch.zeros(2, 8, dtype=torch.long)}, "got causal=True, Tq=8, Tk=48"),
        ({"slopes": torch.ones(2, 2)}, r"needs one slope row \(Hq,\), got slopes of shape \(2, 2\)"),
        ({"document_starts": [0] * T}, "integer tensor, got <class 'list'>"),
    ],
    ids=["rows", "float", "not-causal", "cross", "per-row-slopes", "list"],
)
def test_bad_document_starts_are_one_line(change, message):
    q, k, v, _, slopes, _ = make_packed([T, T], 2, 2, 16)
    q, k, v = map(batched, (q, k, v))  # two rows
    kwargs = {"document_starts": torch.zeros(2, T, dtype=torch.long), "slopes": slopes, "causal": True}
    kwargs.update({key: value for key, value in change.items() if key != "q_len"})
    if "q_len" in change:
        q = q[:, :, -change["q_len"] :]
    with pytest.raises(ValueError, match=message):
        alibi_attention(q, k, v, kwargs.pop("slopes"), backend="torch", **kwargs)
