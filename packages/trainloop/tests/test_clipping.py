import pytest
import torch
from tiny_model import TinyLM

from trainloop import ClipGroups, adamw_param_groups


def test_per_group_clipping_equals_hand_computation():
    torch.manual_seed(0)
    model = TinyLM()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    hand = {n: p.grad.clone() for n, p in model.named_parameters()}
    patterns = {"embed.*": 2.0, "o_proj.*": 0.5, "norm_f.*": 0.1}
    groups = ClipGroups([n for n, _ in model.named_parameters()], patterns, 1.0)
    report = groups.clip([(n, p.grad) for n, p in model.named_parameters()])
    members = {"embed.*": ["embed.weight"], "o_proj.*": ["o_proj.weight", "o_proj.bias"],
               "norm_f.*": ["norm_f.weight", "norm_f.bias"], "default": ["head.weight"]}  # fmt: skip
    thresholds = {**patterns, "default": 1.0}
    total_sq = 0.0
    for group, names in members.items():
        norm = torch.cat([hand[n].flatten() for n in names]).double().norm().item()
        total_sq += norm**2
        factor = min(1.0, thresholds[group] / (norm + 1e-6))
        assert report.norms[group] == pytest.approx(norm, rel=1e-6)
        assert report.factors[group] == pytest.approx(factor, rel=1e-6)
        for n in names:
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, hand[n] * factor)
    assert report.total_norm == pytest.approx(total_sq**0.5, rel=1e-6)
    assert report.factors["embed.*"] < 1 and report.factors["norm_f.*"] < 1


def test_no_threshold_means_measured_not_clipped():
    model = TinyLM()
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    groups = ClipGroups([n for n, _ in model.named_parameters()], None, 0.0)
    report = groups.clip([(n, p.grad) for n, p in model.named_parameters()])
    assert report.factors == {"default": 1.0} and report.norms["default"] > 100
    assert all(torch.all(p.grad == 10.0) for p in model.parameters())


def test_unmatched_pattern_is_an_error():
    with pytest.raises(ValueError, match=r"clip_groups: pattern\(s\) \['layers\.\*'\] match no parameter"):
        ClipGroups(["embed.weight"], {"layers.*": 1.0}, 1.0)


def test_adamw_groups_exclude_norms_and_biases_from_decay():
    model = TinyLM()
    decay, no_decay = adamw_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["embed.weight", "head.weight", "o_proj.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == ["norm_f.bias", "norm_f.weight", "o_proj.bias"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
