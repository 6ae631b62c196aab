"""The Llama-family GGUF export read back with the `gguf` package's reader: every tensor's name, shape and value,
the keys, and the q/k permutation checked against the rotary embedding it must turn into llama.cpp's."""

import numpy as np
import pytest
import torch
from hf_checkpoints import ARCHITECTURES, write_checkpoint
from safetensors.torch import load_file

from lmcore import GPT, ModelConfig, apply_lora, from_hf
from lmcore.gguf_llama import GGUF_ARCHES, bpe_vocab, gguf_llama_mismatches, llama3_rope_factors, write_gguf_llama
from lmcore.gguf_mpt import GGUFVocab
from lmcore.rope import inv_freq

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) writes the test checkpoints")

# Hugging Face module inside a layer -> llama.cpp's tensor (written out here, apart from the code under test).
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def vocab(n: int = 100) -> GGUFVocab:
    return GGUFVocab([f"t{i}" for i in range(n)], [], [1] * n, eos_id=2, bos_id=1, model="gpt2", merges=["t 1"])


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{LAYER[module]}.{kind}"


def interleave(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Within each head, rows (first half i, second half i) made neighbours: an index loop, not the code's reshape."""
    head_dim = rows.shape[0] // n_head
    order = [h * head_dim + j + half * head_dim // 2 for h in range(n_head) for j in range(head_dim // 2)
             for half in (0, 1)]  # fmt: skip
    return rows[order]


def field(reader, key):
    return reader.get_field(key).contents()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("architecture, tied", [(a, False) for a in ARCHITECTURES] + [("Qwen2ForCausalLM", True)])
def test_every_tensor_reads_back_with_llama_cpp_names_shapes_and_values(tmp_path, architecture, tied, dtype):
    write_checkpoint(tmp_path / "hf", architecture, tie_word_embeddings=tied, rope_theta=5e5)
    model = from_hf(tmp_path / "hf")
    write_gguf_llama(model, tmp_path / "m.gguf", vocab(), dtype=dtype)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    arch = GGUF_ARCHES[architecture]
    hf_state = load_file(tmp_path / "hf" / "model.safetensors")
    if tied:
        hf_state.pop("lm_head.weight", None)
    want = {}
    for name, tensor in hf_state.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = interleave(tensor, 4 if ".q_proj." in name else 2)
        want[gguf_name(name)] = tensor.numpy()
    got = {t.name: t for t in reader.tensors}
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        expected = want[name]
        assert [int(x) for x in tensor.shape] == list(reversed(expected.shape)), name  # GGUF: fastest dim first
        data = np.asarray(tensor.data).reshape(expected.shape)
        if dtype == "f16" and expected.ndim == 2:
            assert data.dtype == np.float16
            np.testing.assert_array_equal(data, expected.astype(np.float16), err_msg=name)
        else:
            assert data.dtype == np.float32
            np.testing.assert_array_equal(data, expected, err_msg=name)
    c = model.config
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.block_count") == 2 and field(reader, f"{arch}.context_length") == c.context_length
    assert field(reader, f"{arch}.embedding_length") == 64 and field(reader, f"{arch}.feed_forward_length") == 128
    assert field(reader, f"{arch}.attention.head_count") == 4 and field(reader, f"{arch}.attention.head_count_kv") == 2
    assert field(reader, f"{arch}.rope.freq_base") == 5e5
    assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.merges") == ["t 1"]
    if arch == "llama":
        assert field(reader, "llama.rope.dimension_count") == 16 and field(reader, "llama.vocab_size") == 100


def test_the_permutation_turns_transformers_rotary_into_llama_cpp_interleaved_rotary():
    """llama.cpp's "llama" rope rotates dims (2i, 2i+1) by angle p * theta_i; applied to the permuted q it must give
    the permuted result of transformers' rotate_half rope on the original q."""
    from lmcore.gguf_llama import permute_rotary
    from lmcore.rope import apply_rope, rotary_cos_sin

    config = ModelConfig.from_preset("tiny", position="rope", rope_theta=500.0)
    q = torch.randn(7, 4 * 16, dtype=torch.float64)  # 7 positions, 4 heads of 16
    cos, sin = rotary_cos_sin(config, torch.arange(7), 7, torch.float64)  # (7, 16)
    hf = apply_rope(q.view(7, 4, 16), cos, sin).reshape(7, 64)
    permuted = permute_rotary(q.t(), 4).t().reshape(7, 4, 8, 2)  # rows of the projection = output dims
    angle = torch.arange(7)[:, None].double() * inv_freq(config).double()  # (7, 8)
    a, b = permuted[..., 0], permuted[..., 1]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    llama_cpp = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(7, 64)
    torch.testing.assert_close(llama_cpp, permute_rotary(hf.t(), 4).t(), rtol=1e-6, atol=1e-6)


def test_llama3_scaling_becomes_rope_freqs_and_linear_becomes_keys(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    write_checkpoint(tmp_path / "l3", "LlamaForCausalLM", rope_theta=5e5, rope_scaling=rope)
    model = from_hf(tmp_path / "l3")
    write_gguf_llama(model, tmp_path / "l3.gguf", vocab())
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "l3.gguf").tensors}
    factors = torch.from_numpy(np.asarray(tensors["rope_freqs.weight"].data).copy())
    plain = inv_freq(ModelConfig.from_preset("tiny", position="rope", rope_theta=5e5))
    torch.testing.assert_close(plain / factors, inv_freq(model.config), rtol=1e-6, atol=0)  # llama.cpp divides
    assert set(factors.tolist()) >= {1.0, 8.0} and torch.equal(factors, llama3_rope_factors(model.config))
    write_checkpoint(tmp_path / "lin", "MistralForCausalLM", rope_scaling={"rope_type": "linear", "factor": 4.0})
    write_gguf_llama(from_hf(tmp_path / "lin"), tmp_path / "lin.gguf", vocab())
    reader = gguf.GGUFReader(tmp_path / "lin.gguf")
    assert field(reader, "llama.rope.scaling.type") == "linear" and field(reader, "llama.rope.scaling.factor") == 4.0


def test_what_llama_cpp_cannot_compute_is_refused(tmp_path):
    rope = dict(position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    dynamic = GPT(ModelConfig.from_preset("tiny", **rope, rope_scaling="dynamic", rope_factor=2.0))
    with pytest.raises(ValueError, match=r"rope_scaling='dynamic' \(GGUF llama: none, linear or llama3\)"):
        write_gguf_llama(dynamic, tmp_path / "m.gguf", vocab(97))
    qwen = ModelConfig.from_preset("tiny", **rope, qkv_bias=True, rope_scaling="llama3", rope_factor=8.0)
    assert gguf_llama_mismatches(qwen, "Qwen2ForCausalLM") == ["rope_scaling='llama3' (GGUF qwen2: none or linear)"]
    with pytest.raises(ValueError, match="merge them first"):
        write_gguf_llama(apply_lora(GPT(ModelConfig.from_preset("tiny", **rope)), r=2), tmp_path / "m.gguf", vocab(97))
    with pytest.raises(ValueError, match=r"position='alibi'"):
        write_gguf_llama(GPT(ModelConfig.from_preset("tiny")), tmp_path / "m.gguf", vocab(97))
    assert not (tmp_path / "m.gguf").exists()


def test_bpe_vocab_reads_tokenizer_json_as_the_tokenizers_library_does(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>"]
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(["def main(argv):\n    return 0\n"] * 50 + ["the quick brown fox"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "bos_token": null}')
    v = bpe_vocab(tmp_path, pre="smollm")
    assert {t: i for i, t in enumerate(v.tokens)} == tok.get_vocab()
    assert v.eos_id == 0 and v.bos_id is None and v.types[:2] == [3, 3] and set(v.types[2:]) == {1}
    assert v.merges and all(len(m.split(" ")) == 2 for m in v.merges) and (v.model, v.pre) == ("gpt2", "smollm")
