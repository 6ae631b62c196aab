import dataclasses
import typing

import pytest
import torch

from alibi_kernels import BACKENDS
from lmcore import GPT, PRESETS, ModelConfig, n_params
from lmcore.config import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    CHECKPOINTING,
    INIT_SCHEMES,
    LOSS_LOGITS,
    NORMS,
    POSITIONS,
    ROPE_SCALINGS,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_built_on_meta_device_has_the_closed_form_count(name):
    config = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = GPT(config)
    real = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert real == n_params(config)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(activation="swiglu"),
        dict(tie_embeddings=False),
        dict(bias=False),
        dict(norm="rmsnorm"),
        dict(n_kv_head=1),
        dict(learnable_slopes=True),
        dict(bias=False, norm="rmsnorm", activation="swiglu", n_kv_head=2, tie_embeddings=False, d_ff=100),
        dict(position="rope"),
        dict(position="rope", bias=False, qkv_bias=True),  # Qwen2: biases on q, k, v only
        dict(position="rope", bias=True, qkv_bias=True),  # qkv_bias adds nothing where every layer has one
        dict(
            position="rope",
            rope_scaling="llama3",
            rope_factor=8.0,
            bias=False,
            qkv_bias=True,
            n_kv_head=2,
            norm="rmsnorm",
            activation="swiglu",
            tie_embeddings=False,
        ),
    ],
)
def test_closed_form_count_follows_every_architecture_switch(overrides):
    config = ModelConfig.from_preset("tiny", **overrides)
    real = sum(p.numel() for p in GPT(config).parameters())
    assert real == n_params(config)


def test_non_embedding_count_leaves_out_embedding_and_untied_head():
    config = ModelConfig.from_preset("tiny", tie_embeddings=False)
    embedding = config.vocab_size * config.d_model
    assert n_params(config) - n_params(config, non_embedding=True) == 2 * embedding


def test_gpt3_shapes_of_the_large_presets():
    # GPT-3 XL and 2.7B shapes (XL with 16 heads of 128); the counts come from n_params.
    xl, big = ModelConfig.from_preset("1.3b"), ModelConfig.from_preset("2.7b")
    assert (xl.n_layer, xl.d_model, xl.n_head) == (24, 2048, 16)
    assert (big.n_layer, big.d_model, big.n_head) == (32, 2560, 32)
    assert 1.2e9 < n_params(xl) < 1.4e9 and 2.5e9 < n_params(big) < 2.8e9


def test_cpu_small_is_a_few_million_parameters():
    assert 1e6 < n_params(ModelConfig.from_preset("cpu-small")) < 2e7


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_head=3), "d_model"),
        (dict(n_kv_head=3), "n_kv_head"),
        (dict(norm="batchnorm"), "norm"),
        (dict(activation="relu"), "activation"),
        (dict(dropout=1.5), "dropout"),
        (dict(init="orthogonal"), "init"),
        (dict(checkpointing="full"), "checkpointing"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=10.5), "vocab_size"),
        (dict(d_model=32, n_head=4), "head dim"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(bias="yes"), "bias"),
        (dict(norm_eps=0), "norm_eps"),
    ],
)
def test_bad_configs_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_preset("tiny", **overrides)


def test_a_bad_name_is_refused_listing_the_allowed_ones():
    message = "ModelConfig.norm must be one of ('layernorm', 'rmsnorm'), got 'batchnorm'"
    with pytest.raises(ValueError) as error:
        ModelConfig.from_preset("tiny", norm="batchnorm")
    assert str(error.value) == message


LITERAL_FIELDS = {
    "norm": NORMS,
    "activation": ACTIVATIONS,
    "init": INIT_SCHEMES,
    "checkpointing": CHECKPOINTING,
    "attention_backend": ATTENTION_BACKENDS,
    "position": POSITIONS,
    "rope_scaling": ROPE_SCALINGS,
    "loss_logits": LOSS_LOGITS,
}


def test_literal_field_types_name_the_values_post_init_accepts():
    hints = typing.get_type_hints(ModelConfig)  # resolved as lmtrain's --set resolves them
    literal = {f.name for f in dataclasses.fields(ModelConfig) if typing.get_origin(hints[f.name]) is typing.Literal}
    assert literal == set(LITERAL_FIELDS)
    assert {name: typing.get_args(hints[name]) for name in LITERAL_FIELDS} == LITERAL_FIELDS
    assert ATTENTION_BACKENDS == BACKENDS  # what alibi_kernels.alibi_attention takes


@pytest.mark.parametrize("field, value", [(f, v) for f, values in LITERAL_FIELDS.items() for v in values])
def test_every_name_of_a_literal_field_is_accepted(field, value):
    rope = {"position": "rope"} if field == "rope_scaling" else {}  # a rotary scaling needs rotary positions
    assert getattr(ModelConfig.from_preset("tiny", **rope, **{field: value}), field) == value


def test_unknown_preset_and_unknown_field_are_errors():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ModelConfig.from_preset("huge")
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig.from_dict({"n_layers": 2})


def test_dict_round_trip_keeps_every_field():
    config = ModelConfig.from_preset("tiny", activation="swiglu", n_kv_head=2, learnable_slopes=True)
    again = ModelConfig.from_dict(config.to_dict())
    assert again == config
    assert set(config.to_dict()) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_defaults_resolve_kv_heads_and_mlp_width():
    gelu = ModelConfig.from_preset("tiny")
    swiglu = ModelConfig.from_preset("tiny", activation="swiglu")
    assert gelu.n_kv_head == gelu.n_head and gelu.d_ff == 4 * gelu.d_model
    assert swiglu.d_ff % 64 == 0 and swiglu.d_ff >= 8 * swiglu.d_model / 3
