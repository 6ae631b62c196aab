"""An lmcore GPT as a GGUF file of llama.cpp's MPT architecture, written with the `gguf` package.

llama.cpp's MPT graph: token embedding, then per block LayerNorm -> fused q|k|v projection -> attention with the
ALiBi bias (slopes from `mpt.attention.max_alibi_bias`, 8: the paper's slopes, ours, for any head count) -> output
projection -> residual, LayerNorm -> up -> GELU -> down -> residual; a final LayerNorm and the output head (the
token embedding when no `output.weight` is stored). Every bias, the separate output head and grouped KV heads
are optional tensors and keys there, so biased models, untied heads and n_kv_head < n_head map too. What does not
map: RMSNorm, SwiGLU, learnable slopes, a document separator (`gguf_mismatches` names them). llama.cpp computes
GELU with the tanh approximation: its logits differ from ours by that (see docs/benchmarks.md).

Tensors keep numpy's (out, in) order; GGUF lists dimensions fastest first, so the reader shows (in, out).
With `dtype="f16"` the 2-D weights are stored as float16 and the 1-D ones (norms, biases) stay float32, as
llama.cpp's own converter does for its "f16" file type.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmcore.config import ModelConfig
from lmcore.extras import import_extra
from lmcore.file_writes import refuse_linked

if TYPE_CHECKING:
    from lmcore.model import GPT

ARCH = "mpt"
# The ALiBi bias max of the paper's slopes (2^(-8 h / n)); llama.cpp derives the slopes from it.
ALIBI_BIAS_MAX = 8.0
DTYPES = ("f32", "f16")
# lmcore block module -> GGUF tensor (MPT's fused q|k|v is written from the three projections).
BLOCK_TENSORS = {
    "attn_norm": "attn_norm",
    "self_attn.o_proj": "attn_output",
    "mlp_norm": "ffn_norm",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class GGUFVocab:
    """A vocabulary as llama.cpp's tokenizers read it. `model="llama"` (the default) is SentencePiece-style:
    `tokens[i]` is piece i's text (U+2581 for a space), `scores[i]` its score; `model="gpt2"` is a byte-level BPE
    (Hugging Face tokenizer.json's vocabulary and `merges`, "a b" each; `pre` names llama.cpp's pre-tokenizer,
    e.g. "qwen2" or "smollm"; `scores` may be empty). `types[i]` is the token's kind (1 normal, 2 unknown, 3 control,
    4 user-defined, 6 byte); `bos_id` is the token put in front of every text when `add_bos` is set."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    eos_id: int
    bos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = True
    add_space_prefix: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    model: str = "llama"
    pre: str = "default"
    merges: list[str] = field(default_factory=list)


def gguf_mismatches(config: ModelConfig) -> list[str]:
    """The fields of `config` that llama.cpp's MPT cannot express, as "field=value (GGUF MPT: what it has)";
    empty when the model maps.

    Example:
        >>> gguf_mismatches(ModelConfig.from_preset("tiny"))
        []
        >>> gguf_mismatches(ModelConfig.from_preset("tiny", activation="swiglu", d_ff=None))
        ["activation='swiglu' (GGUF MPT: gelu)"]
    """
    wanted = [
        ("position", "alibi", "ALiBi"),
        ("norm", "layernorm", "layernorm"),
        ("activation", "gelu", "gelu"),
        ("learnable_slopes", False, "fixed slopes"),
        ("document_separator", None, "attention across documents"),
    ]
    return [
        f"{name}={getattr(config, name)!r} (GGUF MPT: {has})"
        for name, want, has in wanted
        if getattr(config, name) != want
    ]


def gguf_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The weights of `model` under llama.cpp's MPT tensor names, float32 on the CPU (numpy's (out, in) order).

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> tensors = gguf_tensors(GPT(ModelConfig.from_preset("tiny")))
        >>> tuple(tensors["blk.0.attn_qkv.weight"].shape), "output.weight" in tensors  # tied head: not stored
        ((192, 64), False)
    """
    from lmcore.lora import lora_modules

    if lora_modules(model):
        raise ValueError("the model has LoRA adapters: merge them first (lmcore.merge_lora)")
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["embed_tokens.weight"], "output_norm.weight": state["norm.weight"]}
    if "norm.bias" in state:
        out["output_norm.bias"] = state["norm.bias"]
    if not model.config.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(model.config.n_layer):
        src, dst = f"layers.{i}.", f"blk.{i}."
        for kind in ("weight", "bias"):
            names = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if all(n in state for n in names):
                out[f"{dst}attn_qkv.{kind}"] = torch.cat(
                    [state[n] for n in names]
                )  # (d + 2 * kv_dim, ...): q, k, v stacked
            for ours, theirs in BLOCK_TENSORS.items():
                if f"{src}{ours}.{kind}" in state:
                    out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
    return out


def short_write_error(exc: OSError, path: Path) -> OSError:
    """numpy's ``tofile`` (GGUFWriter's tensor writes) reports a write the filesystem cut short as ``OSError("N
    requested and M written")``, without an errno: give it the errno of the likely cause, the file size limit
    (EFBIG) when the file reached it, else a full disk (ENOSPC), with the path, so callers can say which."""
    if exc.errno is not None:
        return exc
    import errno
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    if limit != resource.RLIM_INFINITY and size >= limit:
        return OSError(errno.EFBIG, f"File too large (the file size limit, ulimit -f, is {limit} bytes)", str(path))
    return OSError(errno.ENOSPC, f"No space left on device ({exc})", str(path))


def open_writer(gguf: Any, path: str | os.PathLike[str], arch: str, vocab: GGUFVocab, vocab_size: int, *,
                dtype: str, name: str | None) -> Any:  # fmt: skip
    """A gguf.GGUFWriter of llama.cpp's ``arch`` at ``path`` with its name and file type, after the checks every GGUF
    export makes first: ``dtype`` "f32" or "f16", a vocabulary of ``vocab_size`` entries, no link at ``path``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    check_vocab(vocab, vocab_size)
    refuse_linked(path)  # GGUFWriter opens the path itself, and would write through a link there
    writer = gguf.GGUFWriter(path, arch)
    if name:
        writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    return writer


def write_gguf(
    model: GPT,
    path: str | os.PathLike,
    vocab: GGUFVocab,
    *,
    context_length: int,
    dtype: str = "f32",
    name: str | None = None,
) -> None:
    """Write `model` and `vocab` to `path` as a GGUF file of llama.cpp's MPT architecture, in `dtype` ("f32" or
    "f16"). `context_length` is the `mpt.context_length` key (ALiBi runs past it; llama.cpp warns above it).

    Example (needs the gguf extra):
        >>> import tempfile, gguf
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny"))
        >>> vocab = GGUFVocab([f"t{i}" for i in range(97)], [0.0] * 97, [1] * 97, eos_id=2, bos_id=2)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_gguf(model, f"{d}/m.gguf", vocab, context_length=128)
        ...     reader = gguf.GGUFReader(f"{d}/m.gguf")
        ...     [int(x) for x in reader.get_tensor(0).shape], reader.get_field("mpt.block_count").contents()
        ([64, 97], 2)
    """
    gguf = import_extra("gguf", "gguf", "the GGUF export")
    config = model.config
    bad = gguf_mismatches(config)
    if bad:
        raise ValueError(f"the model does not map onto llama.cpp's MPT: {', '.join(bad)}")
    writer = open_writer(gguf, path, ARCH, vocab, config.vocab_size, dtype=dtype, name=name)
    writer.add_context_length(context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_head)
    if config.n_kv_head != config.n_head:
        writer.add_head_count_kv(config.n_kv_head)
    writer.add_layer_norm_eps(config.norm_eps)
    writer.add_max_alibi_bias(ALIBI_BIAS_MAX)

    add_vocab(writer, vocab)
    write_tensors(writer, gguf_tensors(model), dtype, path)


def check_vocab(vocab: GGUFVocab, vocab_size: int) -> None:
    """ValueError unless `vocab` has one token, type (and score, for SentencePiece) per row of the embedding."""
    scores_ok = len(vocab.scores) == len(vocab.tokens) or (vocab.model == "gpt2" and not vocab.scores)
    if len(vocab.tokens) != vocab_size or len(vocab.types) != len(vocab.tokens) or not scores_ok:
        raise ValueError(
            f"the vocabulary has {len(vocab.tokens)} tokens, {len(vocab.scores)} scores and {len(vocab.types)} "
            f"types; the model's vocab_size is {vocab_size}"
        )
    if vocab.model not in ("llama", "gpt2"):
        raise ValueError(f"GGUFVocab.model {vocab.model!r}: expected 'llama' (SentencePiece) or 'gpt2' (BPE)")


def add_vocab(writer: Any, vocab: GGUFVocab) -> None:
    """The tokenizer keys of `vocab` (see GGUFVocab) on a gguf.GGUFWriter."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    writer.add_eos_token_id(vocab.eos_id)
    for add, value in ((writer.add_bos_token_id, vocab.bos_id), (writer.add_unk_token_id, vocab.unk_id),
                       (writer.add_pad_token_id, vocab.pad_id)):  # fmt: skip
        if value is not None:
            add(value)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    for key, value in vocab.extra.items():
        writer.add_string(key, value)


def write_tensors(writer: Any, tensors: dict[str, torch.Tensor], dtype: str, path: str | os.PathLike) -> None:
    """Add `tensors` (float32, numpy's (out, in) order) in `dtype` ("f16": 2-D weights only, as llama.cpp's own
    converter stores them; norms and biases stay float32) and write the header, keys and tensors to `path` (the
    writer's file: a write cut short names it); closes `writer`."""
    import numpy as np

    for tensor_name, tensor in tensors.items():
        array = tensor.numpy()
        if dtype == "f16" and array.ndim == 2:
            array = array.astype(np.float16)
        writer.add_tensor(tensor_name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as exc:
        raise short_write_error(exc, Path(path)) from None
    finally:
        with contextlib.suppress(OSError):  # its flush repeats the failed write; the first error is the one to say
            writer.close()
