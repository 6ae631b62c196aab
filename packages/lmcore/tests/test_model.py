import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmcore import GPT, PRESETS, KVCache, ModelConfig


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny", **overrides))


def test_shapes_and_no_loss_without_labels():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    out = model(ids)
    assert out.logits.shape == (3, 11, model.config.vocab_size)
    assert out.loss is None


def test_loss_is_mean_cross_entropy_over_labels_not_ignored():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    labels = torch.randint(0, model.config.vocab_size, (2, 9))
    labels[0, :4] = -100
    out = model(ids, labels)
    keep = labels != -100
    expected = F.cross_entropy(out.logits[keep], labels[keep])  # mean over the 14 kept positions only
    torch.testing.assert_close(out.loss, expected)


def test_loss_on_one_batch_drops_when_overfitting():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss = model(ids[:, :-1], ids[:, 1:]).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > math.log(model.config.vocab_size) - 0.5  # starts near uniform
    assert loss.item() < 0.3 * first


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_head=1, activation="swiglu", norm="rmsnorm")])
def test_changing_a_later_token_never_changes_an_earlier_logit(overrides):
    model = tiny(**overrides).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % model.config.vocab_size
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-4  # the change is visible from position 12 on


def test_no_learned_position_embedding():
    names = [n for n, _ in tiny().named_parameters()]
    assert not any("pos" in n or "wpe" in n for n in names), names


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_gqa_projects_fewer_kv_heads_and_trains(n_kv_head):
    model = tiny(n_kv_head=n_kv_head)
    attn = model.layers[0].self_attn
    assert attn.k_proj.out_features == n_kv_head * model.config.head_dim
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    model(ids, ids).loss.backward()
    assert attn.k_proj.weight.grad.abs().sum() > 0


def test_gqa_with_kv_heads_copied_equals_multi_head_attention():
    # A GQA model whose k/v weights are duplicated per group computes the same as plain MHA.
    gqa = tiny(n_kv_head=2).eval()
    mha = tiny(n_kv_head=4).eval()
    state = gqa.state_dict()
    hd = gqa.config.head_dim
    for key, value in state.items():
        if ".k_proj." in key or ".v_proj." in key:
            heads = value.view(2, hd, *value.shape[1:])
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * hd, *value.shape[1:])
    mha.load_state_dict(state)
    ids = torch.randint(0, gqa.config.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_cached_decoding_equals_full_recomputation_beyond_the_training_context(n_kv_head):
    model = tiny(n_kv_head=n_kv_head).eval()
    length = 2 * model.config.context_length + 5  # longer than training context: ALiBi has no hard limit
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    full = model(ids).logits
    cache = KVCache(model.config.n_layer)
    prefill = length - 12
    pieces = [model(ids[:, :prefill], kv_cache=cache).logits]
    pieces += [model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(prefill, length - 3)]
    pieces += [model(ids[:, length - 3 :], kv_cache=cache).logits]  # a multi-token step after single ones
    assert len(cache) == length
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["attention", "block"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    plain, ckpt = tiny(), tiny(checkpointing=mode)
    ckpt.load_state_dict(plain.state_dict())
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    plain(ids, ids).loss.backward()
    ckpt(ids, ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_learnable_slopes_receive_gradients_and_fixed_ones_are_not_parameters():
    learn = tiny(learnable_slopes=True)
    ids = torch.randint(0, learn.config.vocab_size, (2, 16))
    learn(ids, ids).loss.backward()
    assert learn.layers[0].self_attn.log_slopes.grad.abs().sum() > 0
    assert not any("slope" in n for n, _ in tiny().named_parameters())
    assert not any("slope" in k for k in tiny().state_dict())


def test_dropout_is_active_in_training_only():
    model = tiny(dropout=0.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b)
    model.eval()
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = tiny()
    assert tied.lm_head.weight is tied.embed_tokens.weight
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_bias_switch_removes_every_bias():
    assert not any(n.endswith("bias") for n, _ in tiny(bias=False).named_parameters())


def test_bad_inputs_raise_value_errors():
    model = tiny()
    with pytest.raises(ValueError, match="vocab_size=97"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.randn(1, 4))


def test_bf16_autocast_forward_and_backward_run():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_fixed_slopes_stay_exact_fp32_after_a_bf16_cast():
    from alibi_kernels import alibi_slopes

    model = tiny(n_head=12, d_model=192).to(torch.bfloat16)  # 2^(-8h/16), h odd, is not exact in bf16
    assert not torch.equal(alibi_slopes(12).bfloat16().float(), alibi_slopes(12))
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    assert model(ids).logits.dtype == torch.bfloat16
    for layer in model.layers:
        assert torch.equal(layer.self_attn.head_slopes(), alibi_slopes(12))


def grads(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["off", "attention", "block"])
def test_zero_dropout_draws_no_random_numbers_and_equals_eval_mode(mode):
    model = tiny(checkpointing=mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model.eval()
    eval_loss = model(ids, ids).loss
    eval_loss.backward()
    eval_grads = grads(model)
    model.zero_grad()
    model.train()
    rng = torch.get_rng_state()
    train_loss = model(ids, ids).loss
    train_loss.backward()
    assert torch.equal(torch.get_rng_state(), rng)  # nn.Dropout(0.0) returns its input without drawing
    assert torch.equal(train_loss, eval_loss)
    for name, grad in grads(model).items():
        assert torch.equal(grad, eval_grads[name]), name


DROPOUT_SITES = ["embed_dropout", "self_attn.resid_dropout", "mlp.dropout"]


def dropout_modules(model: GPT, site: str) -> list[nn.Dropout]:
    return [m for name, m in model.named_modules() if isinstance(m, nn.Dropout) and name.endswith(site)]


def test_dropout_sits_on_the_embeddings_and_both_residual_branches_only():
    model = tiny(dropout=0.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    reference = model.eval()(ids).logits
    found = [m for site in DROPOUT_SITES for m in dropout_modules(model, site)]
    assert len(found) == 1 + 2 * model.config.n_layer
    assert len(found) == sum(isinstance(m, nn.Dropout) for m in model.modules())
    # Training mode with those modules alone switched off is the eval forward: nothing else (attention
    # probabilities included) draws a mask.
    model.train()
    for m in found:
        m.eval()
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)
    for site in DROPOUT_SITES:  # and each site on its own changes the output
        for m in dropout_modules(model, site):
            m.train()
        assert not torch.equal(model(ids).logits, reference), site
        for m in dropout_modules(model, site):
            m.eval()


@pytest.mark.parametrize("mode", ["attention", "block"])
def test_checkpointing_recomputes_with_the_same_dropout_masks(mode):
    plain, ckpt = tiny(dropout=0.3), tiny(dropout=0.3, checkpointing=mode)
    ckpt.load_state_dict(plain.state_dict())
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    losses = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        losses.append(model(ids, ids).loss)
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_no_preset_turns_dropout_on():
    assert all(ModelConfig.from_preset(name).dropout == 0.0 for name in PRESETS)


def test_flops_per_token_is_the_palm_count_at_the_context_length():
    # tiny: vocab 97, 2 layers, width 64, 4 heads of 16, d_ff 256, context 32, biases, tied embeddings.
    d, ff, v = 64, 256, 97
    attention = 4 * (d * d + d)  # q, k, v, o with biases
    mlp = d * ff + ff + ff * d + d
    norms = 2 * 2 * d  # two LayerNorms (weight and bias) per block
    n = 2 * (attention + mlp + norms) + 2 * d + v * d  # + final norm + the tied embedding / output matrix
    assert n == 106_304
    expected = 6 * n + 12 * 2 * 4 * 16 * 32  # 6N + 12 L H Q T
    model = tiny()
    assert model.flops_per_token() == model.flops_per_token(32) == expected == 686_976
    assert model.flops_per_token(64) == 6 * n + 12 * 2 * 4 * 16 * 64
    # An untied input embedding is a lookup: N counts the output matrix once, as with tied weights.
    assert tiny(tie_embeddings=False).flops_per_token() == expected
    # Grouped-query attention shrinks k/v projections, not the per-query-head attention work.
    assert tiny(n_kv_head=1).flops_per_token() == expected - 6 * 2 * 2 * (3 * (d * 16 + 16))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="seq_len"):
            model.flops_per_token(bad)


def test_trainloop_reads_the_model_flops_with_no_argument():
    metrics_logging = pytest.importorskip("trainloop.metrics_logging")
    model = tiny()
    assert metrics_logging.flops_per_token(model, None) == (model.flops_per_token(), "model.flops_per_token")
