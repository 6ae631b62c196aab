"""ModelConfig.loss_logits="labelled": the loss of a forward with labels from the labelled positions' logits alone,
a chunk at a time, recomputed in the backward pass: the same loss and gradients as the whole logits, and no (B, T, V)
tensor kept for the backward pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcore import GPT, ModelConfig, apply_lora
from lmcore import model as model_module


def _pair(**overrides) -> tuple[GPT, GPT]:
    """Two models with the same weights, one per loss_logits setting."""
    torch.manual_seed(0)
    whole = GPT(ModelConfig.from_preset("tiny", **overrides))
    labelled = GPT(dataclasses.replace(whole.config, loss_logits="labelled"))
    labelled.load_state_dict(whole.state_dict())
    return whole, labelled


def _batch(vocab: int, masked: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 17), generator=g)
    labels = torch.randint(0, vocab, (3, 17), generator=g)
    labels[torch.rand(3, 17, generator=g) < masked] = -100  # a prompt's positions carry no label
    return ids, labels


@pytest.mark.parametrize("rows", [5, 2048])  # several chunks, and one
@pytest.mark.parametrize("tied", [True, False])
def test_the_loss_and_every_gradient_equal_the_whole_logits(monkeypatch, rows, tied):
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", rows)
    whole, labelled = _pair(tie_embeddings=tied)
    ids, labels = _batch(whole.config.vocab_size)
    expected, got = whole(ids, labels), labelled(ids, labels)
    assert got.logits is None and expected.logits is not None
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-6)
    expected.loss.backward()
    got.loss.backward()
    grads = dict(labelled.named_parameters())
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_no_vocabulary_wide_tensor_is_kept_for_the_backward_pass():
    whole, labelled = _pair()
    vocab = whole.config.vocab_size
    ids, labels = _batch(vocab)

    def widest_rows(model: GPT) -> int:
        """The most rows of any tensor autograd keeps whose last dimension is the vocabulary (logits, their
        softmax), weights excluded."""
        weights = {p.data_ptr() for p in model.parameters()}
        rows = [0]

        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 2 and t.shape[-1] == vocab and t.data_ptr() not in weights:
                rows.append(t.numel() // vocab)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(ids, labels).loss.backward()
        return max(rows)

    assert widest_rows(whole) >= ids.numel()  # the whole path keeps every position's logits
    assert widest_rows(labelled) == 0  # checkpointed chunks keep their inputs only


def test_no_label_gives_nan_as_the_mean_does_and_a_graph_to_step_back_through():
    whole, labelled = _pair()
    ids, _ = _batch(whole.config.vocab_size)
    none = torch.full_like(ids, -100)
    assert torch.isnan(whole(ids, none).loss) and torch.isnan(labelled(ids, none).loss)
    labelled(ids, none).loss.backward()  # no error: the trainer sees a NaN loss and skips the step


def test_lora_under_bf16_autocast_gives_the_same_loss():
    whole, labelled = _pair()
    for m in (whole, labelled):
        apply_lora(m, r=4)
    labelled.load_state_dict(whole.state_dict())
    ids, labels = _batch(whole.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = whole(ids, labels).loss, labelled(ids, labels).loss
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)  # bf16 logits of different row groups
    got.backward()
    assert all(p.grad is not None for n, p in labelled.named_parameters() if p.requires_grad)


def test_a_model_without_labels_still_returns_its_logits():
    _, labelled = _pair()
    ids, _ = _batch(labelled.config.vocab_size)
    assert labelled(ids).logits.shape == (*ids.shape, labelled.config.vocab_size)
