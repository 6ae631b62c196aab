import math

import pytest
import torch

from lmcore import GPT, INIT_FUNCTIONS, ModelConfig, init_report


def build(scheme: str) -> GPT:
    torch.manual_seed(0)
    # Wider than `tiny` so each weight has enough entries for a tight std estimate (128*128 = 16k samples).
    return GPT(ModelConfig.from_preset("tiny", d_model=128, n_layer=4, init=scheme))


def expected_std(scheme: str, fan_in: int, fan_out: int, residual: bool, n_layer: int, d: int) -> float:
    if scheme == "gpt2":
        return 0.02 / math.sqrt(2 * n_layer) if residual else 0.02
    if scheme == "kaiming":
        return math.sqrt(2 / fan_in) / (math.sqrt(2 * n_layer) if residual else 1.0)
    if scheme == "xavier":
        return math.sqrt(2 / (fan_in + fan_out))
    return 2 / (n_layer * math.sqrt(d)) if residual else math.sqrt(2 / (5 * d))


@pytest.mark.parametrize("scheme", sorted(INIT_FUNCTIONS))
def test_weight_statistics_match_the_scheme(scheme):
    model = build(scheme)
    cfg = model.config
    for name in ("q_proj", "o_proj"):
        w = getattr(model.layers[1].self_attn, name).weight
        want = expected_std(scheme, w.shape[1], w.shape[0], name == "o_proj", cfg.n_layer, cfg.d_model)
        assert w.std().item() == pytest.approx(want, rel=0.05), name
        assert abs(w.mean().item()) < 3 * want / math.sqrt(w.numel())
    w = model.layers[2].mlp.down_proj.weight
    want = expected_std(scheme, w.shape[1], w.shape[0], True, cfg.n_layer, cfg.d_model)
    assert w.std().item() == pytest.approx(want, rel=0.05)
    assert torch.all(model.layers[0].attn_norm.weight == 1) and torch.all(model.norm.bias == 0)
    assert torch.all(model.layers[0].mlp.up_proj.bias == 0)


def test_schemes_differ_from_each_other():
    stds = {s: build(s).layers[0].self_attn.q_proj.weight.std().item() for s in INIT_FUNCTIONS}
    assert len({round(v, 4) for v in stds.values()}) == len(stds), stds


def test_init_report_measures_every_block_and_leaves_no_gradients():
    model = build("gpt2").train()
    batch = torch.randint(0, model.config.vocab_size, (4, 32))
    report = init_report(model, batch)
    names = [r["name"] for r in report.rows]
    assert names == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm"]
    assert all(r["activation_rms"] > 0 and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in report.rows)
    assert report.loss == pytest.approx(math.log(model.config.vocab_size), rel=0.1)  # near-uniform at step 0
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    assert "layers.3" in str(report)


def test_init_report_activation_rms_matches_a_direct_measurement():
    model = build("xavier")
    inputs = torch.randint(0, model.config.vocab_size, (2, 16))
    targets = torch.randint(0, model.config.vocab_size, (2, 16))
    report = init_report(model, (inputs, targets))
    emb = model.embed_tokens(inputs)
    assert report.rows[0]["activation_rms"] == pytest.approx(emb.pow(2).mean().sqrt().item(), rel=1e-5)
    assert report.loss == pytest.approx(model(inputs, targets).loss.item(), rel=1e-5)


def test_unknown_scheme_is_rejected():
    from lmcore import initialize

    with pytest.raises(ValueError, match="orthogonal"):
        initialize(build("gpt2"), "orthogonal")
