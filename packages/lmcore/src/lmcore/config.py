"""ModelConfig, the named presets, and the closed-form parameter count."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

# The names each string field of ModelConfig accepts, as types (so a type checker and lmtrain's `--set` know them)
# and as tuples (what __post_init__ checks and its messages list).
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "swiglu"]
InitScheme = Literal["gpt2", "kaiming", "xavier", "small"]
Checkpointing = Literal["off", "attention", "block"]
# alibi_kernels.BACKENDS as a type; tests/test_config.py checks that the two name the same backends.
AttentionBackend = Literal["auto", "triton", "torch"]
Position = Literal["alibi", "rope"]
LossLogits = Literal["all", "labelled"]
# Hugging Face's rope_type names for the rotary scalings lmcore computes ("none": transformers' "default").
RopeScaling = Literal["none", "linear", "dynamic", "llama3"]

NORMS: tuple[Norm, ...] = get_args(Norm)
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)
INIT_SCHEMES: tuple[InitScheme, ...] = get_args(InitScheme)
CHECKPOINTING: tuple[Checkpointing, ...] = get_args(Checkpointing)
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = get_args(AttentionBackend)
POSITIONS: tuple[Position, ...] = get_args(Position)
ROPE_SCALINGS: tuple[RopeScaling, ...] = get_args(RopeScaling)
LOSS_LOGITS: tuple[LossLogits, ...] = get_args(LossLogits)
# Each Literal field with the names it accepts, in the order __post_init__ checks them.
_CHOICES: dict[str, tuple[str, ...]] = {
    "activation": ACTIVATIONS,
    "norm": NORMS,
    "init": INIT_SCHEMES,
    "checkpointing": CHECKPOINTING,
    "attention_backend": ATTENTION_BACKENDS,
    "position": POSITIONS,
    "rope_scaling": ROPE_SCALINGS,
    "loss_logits": LOSS_LOGITS,
}
# alibi_kernels.alibi_attention accepts head dims in this range (its Triton tiles need D >= 16).
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@dataclass
class ModelConfig:
    """Every size and switch of the decoder-only transformer, flat and validated: ALiBi (the default) or the
    Llama family's rotary positions in one model.

    `n_kv_head=None` means one key/value head per query head (plain multi-head attention);
    fewer KV heads is grouped-query attention. `d_ff=None` picks 4 * d_model for gelu and
    8/3 * d_model (rounded up to a multiple of 64) for swiglu, which keeps the MLP's
    parameter count about equal. `context_length` is the training length: ALiBi has no
    hard limit, so longer inputs still run.

    `document_separator` (a token id, e.g. the token file's EOS) keeps attention inside
    documents in the forward pass without a KV cache (training, evaluation): each row is
    cut after every separator token (the separator closes its document), positions restart
    at 0 in the next document, and no query attends to an earlier document. Decoding with a
    KV cache (`generate`) stays plain causal attention over everything cached: a separator
    inside a prompt or a generated one does not start a new document there.

    `position="rope"` replaces ALiBi by rotary position embeddings as transformers' Llama computes them
    (rotate_half layout, base `rope_theta`), on the same attention kernels with every slope 0. `rope_scaling`
    is Hugging Face's `rope_type`: "none" (their "default"), "linear" (frequencies / `rope_factor`), "dynamic"
    (NTK: the base grows with the sequence length past `rope_original_context`) or "llama3" (Llama 3.1's
    smoothed per-frequency factors, with `rope_low_freq_factor`, `rope_high_freq_factor` and
    `rope_original_context`, their original_max_position_embeddings). `rope_original_context=None` means
    `context_length`. `qkv_bias` puts a bias on q, k and v alone (Qwen2) whatever `bias` says.

    `loss_logits` is how a forward with labels computes its loss, and changes no weight: "all" holds the (B, T, V)
    logits of every position and returns them; "labelled" (what `lmtrain finetune` uses) takes the logits of the
    labelled positions alone, a chunk of rows at a time recomputed in the backward pass, and returns no logits:
    with prompt masking most positions carry no label, and B x T x V fp32 logits are the largest activation of a
    model with a large vocabulary (Qwen2's 151,936).

    Example:
        >>> cfg = ModelConfig.from_preset("tiny", n_kv_head=2)
        >>> cfg.head_dim
        16
    """

    vocab_size: int = 32000
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    d_model: int = 768
    d_ff: int | None = None
    context_length: int = 1024
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    activation: Activation = "gelu"
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    init: InitScheme = "gpt2"
    learnable_slopes: bool = False
    checkpointing: Checkpointing = "off"
    attention_backend: AttentionBackend = "auto"
    document_separator: int | None = None
    position: Position = "alibi"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int | None = None
    qkv_bias: bool = False
    loss_logits: LossLogits = "all"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if not isinstance(self.n_kv_head, int) or self.n_kv_head < 1:
            raise ValueError(f"ModelConfig.n_kv_head must be a positive int or None, got {self.n_kv_head!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"ModelConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
                "(each KV head serves a whole group of query heads)"
            )
        if self.d_model % self.n_head != 0:
            raise ValueError(f"ModelConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not MIN_HEAD_DIM <= self.d_model // self.n_head <= MAX_HEAD_DIM:
            raise ValueError(
                f"ModelConfig.d_model / n_head = {self.d_model // self.n_head} (the head dim) must be in "
                f"{MIN_HEAD_DIM}..{MAX_HEAD_DIM}, the range alibi_kernels supports"
            )
        # The Literal fields: a type checker sees their names, but values from JSON or the command line are strings.
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"ModelConfig.{name} must be one of {allowed}, got {value!r}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model if self.activation == "gelu" else 64 * math.ceil(8 * self.d_model / 3 / 64)
        if not isinstance(self.d_ff, int) or self.d_ff < 1:
            raise ValueError(f"ModelConfig.d_ff must be a positive int or None, got {self.d_ff!r}")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ValueError(f"ModelConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("bias", "tie_embeddings", "learnable_slopes", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        sep = self.document_separator
        if sep is not None and (not isinstance(sep, int) or isinstance(sep, bool) or not 0 <= sep < self.vocab_size):
            raise ValueError(
                f"ModelConfig.document_separator must be None or a token id in [0, vocab_size={self.vocab_size}), "
                f"got {sep!r}"
            )
        self._check_rope()

    def _check_rope(self) -> None:
        for name in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        original = self.rope_original_context
        if original is not None and (not isinstance(original, int) or isinstance(original, bool) or original < 1):
            raise ValueError(f"ModelConfig.rope_original_context must be a positive int or None, got {original!r}")
        if self.position == "alibi" and self.rope_scaling != "none":
            raise ValueError(
                f"ModelConfig.rope_scaling={self.rope_scaling!r} needs position='rope' (ALiBi has no rotary scaling)"
            )
        if self.position == "rope" and self.learnable_slopes:
            raise ValueError("ModelConfig.learnable_slopes=True needs position='alibi' (RoPE has no slopes)")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"ModelConfig.d_model / n_head = {self.head_dim} must be even for position='rope'")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"ModelConfig.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                f"rope_low_freq_factor={self.rope_low_freq_factor} for rope_scaling='llama3'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The preset `name` from PRESETS with `overrides` applied, e.g. `from_preset("1.3b", vocab_size=50257)`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (what config.json holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from a dict; an unknown key is an error naming it (a typo must not be silently ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)


# Named sizes. GPT-3's shapes (125M .. 2.7B: layers, width, heads) with a 32000-token SentencePiece vocabulary
# and a 1024-token training context, the reference 1.3B setup of docs/cluster-3090.md; 1.3b has 16 heads of 128.
# The counts these give come from n_params(); see the README table, never state them from memory.
PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: GQA-capable (4 heads), a few thousand parameters.
    "tiny": dict(vocab_size=97, n_layer=2, n_head=4, d_model=64, context_length=32),
    # What two CPU cores train in minutes (TinyShakespeare). The app may tune this entry.
    # Tuned by lmtrain on the TinyShakespeare benchmark (docs/benchmarks.md): at a few CPU-minutes a narrow model
    # at a short context sees more tokens and beats a wider one. Without biases, so that the default run exports as
    # transformers' own MPT (no custom code); what that costs on the headline benchmarks is in docs/benchmarks.md.
    "cpu-small": dict(vocab_size=2048, n_layer=4, n_head=4, d_model=128, context_length=128, bias=False),
    "125m": dict(n_layer=12, n_head=12, d_model=768),
    "350m": dict(n_layer=24, n_head=16, d_model=1024),
    "760m": dict(n_layer=24, n_head=16, d_model=1536),
    "1.3b": dict(n_layer=24, n_head=16, d_model=2048),
    "2.7b": dict(n_layer=32, n_head=32, d_model=2560),
}


def n_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
    """The number of trainable parameters GPT(config) has, from a closed form (no model is built).

    With `non_embedding=True` the token embedding and an untied output head are left out
    (the convention of the scaling-law papers). Learnable slopes count n_head per layer.

    Example:
        >>> n_params(ModelConfig.from_preset("125m")), n_params(ModelConfig.from_preset("125m"), non_embedding=True)
        (109632000, 85056000)
        >>> from lmcore import GPT
        >>> tiny = ModelConfig.from_preset("tiny")
        >>> n_params(tiny), sum(p.numel() for p in GPT(tiny).parameters())  # the closed form, and a model counted
        (106304, 106304)
    """
    assert config.n_kv_head is not None and config.d_ff is not None  # __post_init__ replaces None by the default
    d, ff, v, b = config.d_model, config.d_ff, config.vocab_size, int(config.bias)
    qkv_b = int(config.bias or config.qkv_bias)
    kv = config.n_kv_head * config.head_dim
    norm = d * (2 if config.norm == "layernorm" and config.bias else 1)
    attention = d * d + 2 * d * kv + d * d + qkv_b * (d + 2 * kv) + b * d  # q, k, v, o (RoPE has no parameters)
    n_in = 1 if config.activation == "gelu" else 2  # up (+ gate for swiglu)
    mlp = (n_in + 1) * d * ff + b * (n_in * ff + d)  # in projections + down
    slopes = config.n_head if config.learnable_slopes else 0
    per_layer = attention + mlp + 2 * norm + slopes
    body = config.n_layer * per_layer + norm  # + final norm
    if non_embedding:
        return body
    head = 0 if config.tie_embeddings else v * d
    return body + v * d + head


def flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token by PaLM's appendix B convention: 6*N + 12*L*H*Q*T.

    T is `seq_len`, the tokens per sequence (default `config.context_length`); L layers, H heads, Q head dim.

    N counts the weights that multiply an activation once per token: every parameter of `n_params(config)`
    except an untied input embedding, which is a table lookup. With tied embeddings (the default) N is all
    parameters, the shared matrix doing the output layer's matmul. Norm weights, biases and learnable slopes
    are counted too (a negligible share). 6*N is 2 FLOPs per weight forward and 4 backward; 12*L*H*Q*T is
    attention's scores and weighted sum (2 * 2*H*Q*T per layer forward, times 3 for training) over all T keys,
    as PaLM counts it (no halving for the causal mask), for the H query heads of dim Q (grouped-query attention
    shares keys and values, not this work). Rotary positions add no parameters and their rotation of q and k
    (a few elementwise FLOPs per element) is left out, as PaLM leaves out norms and softmax.

    Example:
        >>> flops_per_token(ModelConfig.from_preset("tiny"))  # 6 * 106,304 + 12 * 2 * 4 * 16 * 32
        686976.0
    """
    seq_len = config.context_length if seq_len is None else seq_len
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int or None (the context length), got {seq_len!r}")
    weights = n_params(config) - (0 if config.tie_embeddings else config.vocab_size * config.d_model)
    attention = 12 * config.n_layer * config.n_head * config.head_dim * seq_len
    return float(6 * weights + attention)
