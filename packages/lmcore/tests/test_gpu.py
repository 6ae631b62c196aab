"""Checks that need CUDA (skipped here): the Triton attention path inside the model, and real allocations."""

import pytest
import torch

from lmcore import GPT, KVCache, ModelConfig, estimate_memory, n_params

pytestmark = pytest.mark.gpu


def small_config(**overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", d_model=256, n_head=4, n_layer=2, **overrides)


def _peaked(model: GPT) -> GPT:
    """Weights far from init (matrices normal(0, 0.1)): attention and logits are peaked, as after training. At init
    the logits are near uniform and an attention bug moves them by less than bf16 rounding."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("fault", [None, "slopes_reversed"])
@pytest.mark.parametrize("document_separator", [None, 2])
@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_triton_backend_matches_torch_backend_in_the_model(n_kv_head, document_separator, fault):
    # Logits and a gradient under bf16 autocast, each backend against the float64 model: the Triton path's error at
    # most twice the torch path's (the FlashAttention rule, at the model's output). A broken twin reverses the
    # slopes of the Triton model's first layer: the same check must fail on it.
    torch.manual_seed(0)
    config = dict(n_kv_head=n_kv_head, document_separator=document_separator)
    torch_model = _peaked(GPT(small_config(attention_backend="torch", **config))).cuda()
    triton_model = GPT(small_config(attention_backend="triton", **config)).cuda()
    triton_model.load_state_dict(torch_model.state_dict())
    reference = GPT(small_config(attention_backend="torch", **config)).cuda().double()
    reference.load_state_dict(torch_model.state_dict())
    if fault == "slopes_reversed":
        attn = triton_model.layers[0].self_attn
        attn.slopes = attn.slopes.flip(0)
    ids = torch.randint(3, 97, (2, 129), device="cuda")
    ids[0, [10, 50, 51, 100]] = 2  # with document attention, inputs of row 0 are documents of 11, 40, 1, 49, 27 tokens
    out = {}
    for name, model in (("torch", torch_model), ("triton", triton_model), ("float64", reference)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=name != "float64"):
            result = model(ids[:, :-1], ids[:, 1:])
        result.loss.backward()
        out[name] = (result.logits.detach().double(), model.layers[0].self_attn.q_proj.weight.grad.double())
    assert out["float64"][0].std() > 1.0  # peaked: logits far from uniform
    errors = {name: [(a - b).norm().item() / b.norm().item() for a, b in zip(out[name], out["float64"], strict=True)]
              for name in ("torch", "triton")}  # fmt: skip
    within = [tri <= 2 * tor + 1e-4 for tri, tor in zip(errors["triton"], errors["torch"], strict=True)]
    assert within == ([True, True] if fault is None else [False, False]), errors


def test_cached_decoding_equals_full_recomputation_on_cuda():
    torch.manual_seed(0)
    model = GPT(small_config(n_kv_head=2)).cuda().eval()
    ids = torch.randint(0, 97, (2, 80), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache(model.config.n_layer)
        steps = [model(ids[:, :70], kv_cache=cache).logits]
        steps += [model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(70, 80)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-3, atol=1e-3)


def test_a_training_step_makes_no_host_sync_on_cuda():
    torch.manual_seed(0)
    model = GPT(small_config(dropout=0.1, checkpointing="block")).cuda()
    ids = torch.randint(0, 97, (2, 64), device="cuda")
    model(ids, ids).loss.backward()  # warm-up: Triton compiles its kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call now raises
    try:
        model(ids, ids).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert model.embed_tokens.weight.grad.abs().sum() > 0


def test_fp32_adam_model_states_are_16_bytes_per_parameter():
    config = ModelConfig.from_preset("125m")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = GPT(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 128), device="cuda")
    model(ids, ids).loss.backward()
    opt.step()
    used = torch.cuda.memory_allocated() - base  # weights + grads + Adam m, v (activations are freed)
    est = estimate_memory(config, 1, 128, "fp32")
    assert used == pytest.approx(est.model_states, rel=0.05)
    assert est.model_states == 16 * n_params(config)
