"""The GGUF export read back with the `gguf` package's own reader: llama.cpp's MPT names, shapes, types, and the
values of every tensor against the model's."""

import numpy as np
import pytest
import torch

from lmcore import GPT, ModelConfig
from lmcore.gguf_mpt import GGUFVocab, gguf_mismatches, write_gguf

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")


def vocab(n: int) -> GGUFVocab:
    return GGUFVocab([f"t{i}" for i in range(n)], [-float(i) for i in range(n)], [1] * n, eos_id=2, bos_id=2)


def field(reader, key):
    return reader.get_field(key).contents()


def llama_cpp_tensors(model: GPT) -> dict[str, np.ndarray]:
    """Every tensor llama.cpp's MPT reads, named here from the model's modules (not through `gguf_tensors`), in
    numpy's (out, in) order: what the file must hold, no more."""

    def a(t):
        return t.detach().float().numpy()

    want = {"token_embd.weight": a(model.embed_tokens.weight)}
    for i, block in enumerate(model.layers):
        attn, mlp = block.self_attn, block.mlp
        modules = {"attn_norm": block.attn_norm, "attn_output": attn.o_proj, "ffn_norm": block.mlp_norm,
                   "ffn_up": mlp.up_proj, "ffn_down": mlp.down_proj}  # fmt: skip
        for kind in ("weight", "bias"):
            qkv = [getattr(m, kind) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
            if qkv[0] is not None:
                want[f"blk.{i}.attn_qkv.{kind}"] = np.concatenate([a(t) for t in qkv])  # q rows, then k, then v
            want |= {
                f"blk.{i}.{n}.{kind}": a(getattr(m, kind)) for n, m in modules.items() if getattr(m, kind) is not None
            }
    want["output_norm.weight"] = a(model.norm.weight)
    if model.norm.bias is not None:
        want["output_norm.bias"] = a(model.norm.bias)
    if not model.config.tie_embeddings:
        want["output.weight"] = a(model.lm_head.weight)
    return want


def assert_every_tensor_is_the_models(reader, model: GPT, dtype: str) -> None:
    """Names, shapes (numpy order) and values of every tensor in the file against the model's own; 2-D weights
    rounded to float16 in an f16 file, exactly."""
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = llama_cpp_tensors(model)
    assert sorted(stored) == sorted(want)
    for name, ours in want.items():
        assert stored[name].shape == ours.shape, (name, stored[name].shape, ours.shape)
        exact = ours.astype(np.float16).astype(np.float32) if dtype == "f16" and ours.ndim == 2 else ours
        np.testing.assert_array_equal(stored[name].astype(np.float32), exact, err_msg=name)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(bias=False), dict(tie_embeddings=False, n_kv_head=2)],
    ids=["biased-tied", "bias-free", "untied-gqa"],
)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_tensors_read_back_with_llama_cpp_names_shapes_and_values(tmp_path, overrides, dtype):
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny", **overrides))
    with torch.no_grad():  # no two tensors alike (norms start at ones, biases at zeros): a swapped pair shows
        for param in model.parameters():
            param.normal_()
    c = model.config
    write_gguf(model, tmp_path / "m.gguf", vocab(c.vocab_size), context_length=4 * c.context_length, dtype=dtype)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    kv = c.n_kv_head * c.d_model // c.n_head
    want = {"token_embd.weight": [c.d_model, c.vocab_size], "output_norm.weight": [c.d_model]}
    for i in range(c.n_layer):
        want |= {
            f"blk.{i}.attn_norm.weight": [c.d_model],
            f"blk.{i}.attn_qkv.weight": [c.d_model, c.d_model + 2 * kv],  # GGUF lists the fastest dimension first
            f"blk.{i}.attn_output.weight": [c.d_model, c.d_model],
            f"blk.{i}.ffn_norm.weight": [c.d_model],
            f"blk.{i}.ffn_up.weight": [c.d_model, c.d_ff],
            f"blk.{i}.ffn_down.weight": [c.d_ff, c.d_model],
        }
        if c.bias:
            want |= {f"blk.{i}.{n}.bias": [s] for n, s in [("attn_norm", c.d_model), ("ffn_norm", c.d_model),
                     ("attn_qkv", c.d_model + 2 * kv), ("attn_output", c.d_model), ("ffn_up", c.d_ff),
                     ("ffn_down", c.d_model)]}  # fmt: skip
    if c.bias:
        want["output_norm.bias"] = [c.d_model]
    if not c.tie_embeddings:
        want["output.weight"] = [c.d_model, c.vocab_size]
    assert {name: [int(x) for x in t.shape] for name, t in tensors.items()} == want
    two_d = "F16" if dtype == "f16" else "F32"
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2} == {two_d}
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 1} == {"F32"}  # norms, biases

    assert_every_tensor_is_the_models(reader, model, dtype)

    assert field(reader, "general.architecture") == "mpt"
    assert field(reader, "general.file_type") == (1 if dtype == "f16" else 0)
    assert field(reader, "mpt.context_length") == 4 * c.context_length
    assert field(reader, "mpt.block_count") == c.n_layer
    assert field(reader, "mpt.embedding_length") == c.d_model
    assert field(reader, "mpt.feed_forward_length") == c.d_ff
    assert field(reader, "mpt.attention.head_count") == c.n_head
    assert field(reader, "mpt.attention.max_alibi_bias") == 8.0
    assert field(reader, "mpt.attention.layer_norm_epsilon") == pytest.approx(c.norm_eps)
    assert (reader.get_field("mpt.attention.head_count_kv") is None) == (c.n_kv_head == c.n_head)
    assert field(reader, "tokenizer.ggml.tokens")[:3] == ["t0", "t1", "t2"]
    assert field(reader, "tokenizer.ggml.bos_token_id") == field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.ggml.add_space_prefix") is False


def test_models_llama_cpp_cannot_run_are_refused_naming_the_setting(tmp_path):
    config = ModelConfig.from_preset("tiny", activation="swiglu", d_ff=None, norm="rmsnorm")
    assert gguf_mismatches(config) == ["norm='rmsnorm' (GGUF MPT: layernorm)", "activation='swiglu' (GGUF MPT: gelu)"]
    rope = ModelConfig.from_preset("tiny", position="rope")  # lmcore.gguf_llama writes rotary models
    assert gguf_mismatches(rope) == ["position='rope' (GGUF MPT: ALiBi)"]
    with pytest.raises(ValueError, match="activation='swiglu'"):
        write_gguf(GPT(config), tmp_path / "m.gguf", vocab(config.vocab_size), context_length=32)
    with pytest.raises(ValueError, match="vocab_size is 97"):
        write_gguf(GPT(ModelConfig.from_preset("tiny")), tmp_path / "m.gguf", vocab(5), context_length=32)
    assert not (tmp_path / "m.gguf").exists()
