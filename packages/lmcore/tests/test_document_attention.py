"""`ModelConfig.document_separator`: attention kept inside the packed documents of each row."""

import os

import pytest
import torch

import lmcore.model
from alibi_kernels import alibi_attention
from lmcore import GPT, KVCache, ModelConfig, document_boundaries

SEP = 2  # the separator id of these tests; documents draw their other tokens from [3, vocab)
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CONFIGS = [dict(), dict(n_kv_head=2, activation="swiglu", norm="rmsnorm")]  # gelu/layernorm; GQA


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny", **overrides))


def pair(**overrides) -> tuple[GPT, GPT]:
    """(plain model, the same weights with document_separator=SEP)."""
    plain = tiny(**overrides)
    docs = tiny(document_separator=SEP, **overrides)
    docs.load_state_dict(plain.state_dict())
    return plain, docs


def document(length: int, *, closed: bool, generator: torch.Generator) -> torch.Tensor:
    body = torch.randint(3, 97, (length - int(closed),), generator=generator)
    return torch.cat([body, torch.tensor([SEP])]) if closed else body


def packed_rows() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Two rows of 16 tokens: [A..SEP, B..SEP, C..] and [D..SEP, E..] (and each row's documents)."""
    g = torch.Generator().manual_seed(1)
    shapes = [[(5, True), (7, True), (4, False)], [(9, True), (7, False)]]  # (length, ends with SEP)
    rows = [[document(n, closed=closed, generator=g) for n, closed in row] for row in shapes]
    return torch.stack([torch.cat(docs) for docs in rows]), rows


def loop_boundaries(ids: torch.Tensor, separator: int) -> list[int]:
    """The per-row Python loop that document_boundaries replaces: the yardstick."""
    cu, offset = [0], 0
    for row in ids.tolist():
        for t, token in enumerate(row):
            if token == separator or t == len(row) - 1:
                cu.append(offset + t + 1)
        offset += len(row)
    return cu


def test_boundaries_example_and_edge_rows():
    ids = torch.tensor([[SEP, 5, 6, SEP], [SEP, SEP, SEP, SEP], [7, 8, 9, 10]])
    docs = document_boundaries(ids, SEP)
    assert docs.cu_seqlens.tolist() == [0, 1, 4, 5, 6, 7, 8, 12]  # (1, 3), (1, 1, 1, 1), (4,)
    assert docs.cu_seqlens.dtype == torch.int32 and docs.max_seqlen == 4


def test_boundaries_equal_a_per_row_loop_on_random_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, 6, (3, 11), generator=g)  # a separator in about one token of six
        assert document_boundaries(ids, SEP).cu_seqlens.tolist() == loop_boundaries(ids, SEP)


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1"))],
)
@pytest.mark.parametrize("overrides", CONFIGS)
def test_packed_row_equals_each_document_run_alone(overrides, backend):
    plain, docs_model = pair(attention_backend=backend, **overrides)
    plain.eval(), docs_model.eval()
    ids, rows = packed_rows()
    with torch.no_grad():
        packed = docs_model(ids).logits  # (2, 16, V)
        for r, documents in enumerate(rows):
            start = 0
            for doc in documents:
                alone = plain(doc[None]).logits[0]  # positions restart at 0, nothing before it
                torch.testing.assert_close(packed[r, start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
                start += len(doc)
        # The plain model on the packed rows differs after the first separator: the documents did leak there.
        leaky = plain(ids).logits
    assert (leaky[0, 5:] - packed[0, 5:]).abs().max() > 1e-3
    torch.testing.assert_close(leaky[0, :5], packed[0, :5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("separator", [SEP, None])
def test_loss_on_one_document_has_no_gradient_from_an_earlier_one(separator):
    model = tiny(document_separator=separator)
    ids, _ = packed_rows()
    captured = []
    model.embed_tokens.register_forward_hook(lambda _m, _i, out: captured.append(out) or out.retain_grad())
    labels = torch.full_like(ids, -100)
    labels[0, 12:] = ids[0, 12:]  # the loss reads only document C of row 0
    model(ids, labels).loss.backward()
    grad = captured[0].grad  # (B, T, C): d loss / d embedding of each token
    assert grad[0, 12:].abs().max() > 0
    assert grad[1].abs().max() == 0  # other rows never interact
    if separator is None:
        assert grad[0, :5].abs().max() > 0  # document A reaches C through plain causal attention
    else:
        assert grad[0, :12].abs().max() == 0  # documents A and B: exactly zero


def test_none_is_the_unchanged_code_path_bit_for_bit(monkeypatch):
    def no_documents(*args, document_starts=None, **kwargs):
        assert document_starts is None, "document_separator=None must not pass document_starts"
        return alibi_attention(*args, **kwargs)

    monkeypatch.setattr(lmcore.model, "alibi_attention", no_documents)
    unset, explicit = tiny(), tiny(document_separator=None)
    ids, _ = packed_rows()  # holds SEP: with None it is an ordinary token
    out_a, out_b = unset(ids, ids), explicit(ids, ids)
    assert torch.equal(out_a.logits, out_b.logits)
    out_a.loss.backward()
    out_b.loss.backward()
    for (name, a), (_, b) in zip(unset.named_parameters(), explicit.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("overrides", CONFIGS)
def test_rows_without_a_separator_equal_the_plain_model(overrides):
    plain, docs_model = pair(**overrides)
    ids = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    a, b = plain(ids, ids), docs_model(ids, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (name, pa), (_, pb) in zip(plain.named_parameters(), docs_model.named_parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_kv_cache_decoding_stays_plain_causal_attention():
    # The documented caveat: with a cache, a separator in the prompt does not start a new document.
    plain, docs_model = pair()
    plain.eval(), docs_model.eval()
    ids, _ = packed_rows()
    with torch.no_grad():
        cached = docs_model(ids, kv_cache=KVCache(docs_model.config.n_layer)).logits
        torch.testing.assert_close(cached, plain(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["attention", "block"])
def test_training_step_with_checkpointing_gives_the_same_gradients(mode):
    ids, _ = packed_rows()
    models = [tiny(document_separator=SEP, learnable_slopes=True, checkpointing=c) for c in ("off", mode)]
    for model in models:
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
    assert models[0].layers[0].self_attn.log_slopes.grad.abs().sum() > 0
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    opt = torch.optim.SGD(models[1].parameters(), lr=0.5)
    before = models[1](ids[:, :-1], ids[:, 1:]).loss.item()
    opt.step()
    assert models[1](ids[:, :-1], ids[:, 1:]).loss.item() < before


@pytest.mark.parametrize("value", [97, -1, True, 2.0, "2"])
def test_bad_separator_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="document_separator"):
        ModelConfig.from_preset("tiny", document_separator=value)


def test_separator_survives_the_dict_and_pretrained_round_trips(tmp_path):
    config = ModelConfig.from_preset("tiny", document_separator=SEP)
    assert ModelConfig.from_dict(config.to_dict()).document_separator == SEP
    assert GPT.from_pretrained(tiny(document_separator=SEP).save_pretrained(tmp_path)).config.document_separator == SEP
