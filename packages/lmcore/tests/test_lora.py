import pytest
import torch

from lmcore import GPT, LoRALinear, ModelConfig, apply_lora, load_lora, merge_lora, save_lora


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny", **overrides))


def train_adapters(model: GPT, ids: torch.Tensor, steps: int = 5) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        opt.step()


def test_zero_start_keeps_outputs_and_only_adapters_require_grad():
    model = tiny().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    before = model(ids).logits
    apply_lora(model, r=4, alpha=16, dropout=0.1)
    assert torch.equal(model(ids).logits, before)  # B = 0: exactly the base model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    adapter = model.layers[0].self_attn.q_proj
    assert torch.all(adapter.lora_B == 0) and adapter.lora_A.abs().sum() > 0
    assert adapter.scaling == pytest.approx(16 / 4)


def test_mlp_targets_on_request():
    model = apply_lora(tiny(activation="swiglu"), targets=["mlp"], r=2)
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {"gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ValueError, match="unknown LoRA target"):
        apply_lora(tiny(), targets=["qkv"])


def test_training_moves_only_adapters_and_merge_keeps_outputs():
    model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    base_logits = model.eval()(ids).logits.detach()
    apply_lora(model.train(), r=4, alpha=8)
    train_adapters(model, ids)
    for key, value in model.state_dict().items():
        if "lora_" not in key:
            assert torch.equal(value, base[key.replace(".base.", ".")]), key
    model.eval()
    adapted = model(ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters learned something
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(ids).logits, adapted, rtol=1e-5, atol=1e-5)
    assert all(p.requires_grad for p in model.parameters())
    assert set(model.state_dict()) == set(base)


def test_adapters_save_and_load_on_their_own(tmp_path):
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    apply_lora(model, targets=("q", "v"), r=4, alpha=16)
    train_adapters(model, ids)
    path = save_lora(model, tmp_path / "adapters.safetensors")
    from safetensors.torch import load_file

    assert all("lora_" in k for k in load_file(path))
    fresh = load_lora(tiny(), path)  # same base weights (seeded), adapters applied from the file's settings
    torch.testing.assert_close(fresh.eval()(ids).logits, model.eval()(ids).logits)
    with pytest.raises(ValueError, match="does not match"):
        load_lora(apply_lora(tiny(), targets=("o",), r=4), path)


def test_double_apply_and_merge_without_adapters_are_errors():
    model = apply_lora(tiny())
    with pytest.raises(ValueError, match="already"):
        apply_lora(model)
    with pytest.raises(ValueError, match="no LoRA"):
        merge_lora(tiny())


@pytest.mark.parametrize(
    ("settings", "pattern"),
    [('{"r": 4}', r"lora_settings metadata lacks targets, alpha, dropout"),
     ("[4]", r"lora_settings metadata holds a list, expected an object"),
     ('{"targets": "q_proj", "r": 4, "alpha": 8, "dropout": 0}', r"lora_settings targets='q_proj': expected a list"),
     ('{"targets": ["q_proj"], "r": 4, "alpha": null, "dropout": 0}', r"lora_settings alpha=None"),
     ("r=4", r"lora_settings metadata is not JSON")],
    ids=["lacking fields", "a list", "targets a string", "alpha null", "not JSON"],
)  # fmt: skip
def test_adapters_file_with_bad_settings_is_a_value_error_naming_it(tmp_path, settings, pattern):
    from safetensors.torch import save_file

    path = tmp_path / "adapters.safetensors"
    save_file({"layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 64)}, path, metadata={"lora_settings": settings})
    with pytest.raises(ValueError, match=r"adapters\.safetensors: " + pattern):
        load_lora(tiny(), path)


def test_adapters_on_a_bf16_base_train_in_fp32_and_keep_small_steps():
    model = apply_lora(tiny().to(torch.bfloat16), r=4, alpha=8)
    adapter = model.layers[0].self_attn.q_proj
    assert adapter.base.weight.dtype == torch.bfloat16 and adapter.lora_A.dtype == adapter.lora_B.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    assert model(ids).logits.dtype == torch.bfloat16  # no autocast: the update is cast back to the base's dtype
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)  # finetune's default rate
    for _ in range(2):  # A's gradient is 0 while B is 0: its first move is on the second step
        before = adapter.lora_A.detach().clone()
        opt.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        opt.step()
    # Steps of about 2e-4: in bf16 about half of A's entries (|a| > 1/16) would round back to where they were.
    assert (adapter.lora_A != before).float().mean() > 0.99
    merged = merge_lora(model)
    assert merged.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # merged into the base's dtype
