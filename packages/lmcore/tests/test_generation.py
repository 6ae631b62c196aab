import pytest
import torch

from lmcore import GPT, ModelConfig, generate
from lmcore.generation import filter_logits


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny")).eval()


def test_greedy_generation_equals_argmax_of_full_recomputation(model):
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    out = generate(model, prompt, 12, temperature=0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    for t in range(5, 17):
        assert torch.equal(out[:, t], model(out[:, :t]).logits[:, -1].argmax(-1))


def test_prompt_longer_than_training_context_generates(model):
    prompt = torch.randint(0, model.config.vocab_size, (1, 3 * model.config.context_length))
    out = generate(model, prompt, 4, temperature=0)
    assert torch.equal(out[:, -1], model(out[:, :-1]).logits[:, -1].argmax(-1))


def test_same_seed_same_sample_different_seed_differs(model):
    prompt = torch.zeros(4, 1, dtype=torch.long)
    a = generate(model, prompt, 20, seed=1)
    b = generate(model, prompt, 20, seed=1)
    c = generate(model, prompt, 20, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_one_is_greedy(model):
    prompt = torch.randint(0, model.config.vocab_size, (2, 4))
    assert torch.equal(generate(model, prompt, 8, top_k=1, seed=3), generate(model, prompt, 8, temperature=0))


def test_eos_stops_rows_and_pads_them_with_eos(model):
    prompt = torch.randint(0, model.config.vocab_size, (3, 4))
    greedy = generate(model, prompt, 6, temperature=0)
    eos = int(greedy[0, 5])  # row 0 emits it as its second new token
    out = generate(model, prompt, 6, temperature=0, eos_id=eos)
    assert torch.all(out[0, 5:] == eos)
    for row in out:
        hits = (row[4:] == eos).nonzero()
        if len(hits):
            assert torch.all(row[4 + hits[0, 0] :] == eos)
    all_eos = generate(model, prompt, 50, temperature=0, eos_id=int(greedy[0, 4]))
    assert all_eos.shape[1] <= 4 + 50


def test_filter_logits_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_logits(probs.log(), top_p=0.75))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(probs.log(), top_p=0.1))
    assert kept.tolist() == [[True, False, False, False]]
    kept = torch.isfinite(filter_logits(probs.log(), top_k=3))
    assert kept.tolist() == [[True, True, True, False]]


def test_bad_arguments_raise(model):
    prompt = torch.zeros(1, 2, dtype=torch.long)
    for kwargs in (dict(top_p=0.0), dict(top_k=0), dict(temperature=-1.0)):
        with pytest.raises(ValueError):
            generate(model, prompt, 2, **kwargs)


def test_generate_restores_each_module_mode(model):
    model.train()
    model.layers[0].mlp.eval()
    generate(model, torch.zeros(1, 2, dtype=torch.long), 2)
    assert model.training and model.layers[1].mlp.training
    assert not model.layers[0].mlp.training and not model.layers[0].mlp.dropout.training


def test_a_model_left_in_training_mode_generates_without_dropout():
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny", dropout=0.5))
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    reference = generate(model.eval(), prompt, 10, temperature=0.8, seed=4)
    model.train()
    rng = torch.get_rng_state()
    assert torch.equal(generate(model, prompt, 10, temperature=0.8, seed=4), reference)
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout mask drawn from the global generator
    greedy = generate(model, prompt, 10, temperature=0)
    for t in range(5, 15):
        assert torch.equal(greedy[:, t], model.eval()(greedy[:, :t]).logits[:, -1].argmax(-1))


def poison(model, name, value):
    with torch.no_grad():
        model.get_parameter(name).view(-1)[0] = value


@pytest.mark.parametrize("kwargs", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=0), dict(eos_id=3)])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_raise_one_error_naming_them(model, kwargs, value):
    poison(model, "layers.1.mlp.down_proj.bias", value)
    with pytest.raises(
        ValueError,
        match=r"logits contain NaN or inf: 1 parameter tensor\(s\) hold NaN or inf "
        r"\(layers\.1\.mlp\.down_proj\.bias\)",
    ):
        generate(model, torch.zeros(2, 3, dtype=torch.long), 4, **kwargs)


def test_overflowing_activations_with_finite_weights_are_named(model):
    with torch.no_grad():
        model.norm.weight.fill_(3e38)  # finite, but the final activations and the logits overflow to inf
    with pytest.raises(ValueError, match="every parameter is finite"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, seed=0)
