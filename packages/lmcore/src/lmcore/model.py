"""The decoder-only transformer: ALiBi attention or rotary positions (the Llama family), pre-norm blocks, GQA.

One model with switches (`ModelConfig`): ALiBi (no position embedding) by default; `position="rope"` rotates
queries and keys as transformers' Llama does (lmcore.rope) and runs the same attention kernels with every slope 0,
which is plain causal attention, so the fused Triton path and the packed-document path serve both.

Parameter names follow the Llama/HF layout (`layers.3.self_attn.o_proj.weight`), so per-group clipping
patterns written for that layout (`layers.*.self_attn.o_proj`) apply unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from alibi_kernels import alibi_attention, alibi_slopes
from lmcore.config import ModelConfig
from lmcore.config import flops_per_token as config_flops_per_token
from lmcore.documents import document_starts
from lmcore.init_schemes import initialize
from lmcore.rope import apply_rope, rotary_cos_sin

# cos and sin of each token's rotary angle, (B or 1, T, head_dim).
Rotary = tuple[Tensor, Tensor]


class Packed(NamedTuple):
    """The documents of one forward's (B, T) batch, found once and shared by every layer."""

    starts: Tensor  # (B, T) the first token of each token's document (lmcore.documents.document_starts)


def check_token_ids(input_ids: Tensor, vocab_size: int) -> None:
    """Raise ValueError unless every id of `input_ids` is in [0, vocab_size), naming the range found.

    Reads the ids on the host: free on CPU, where `GPT.forward` calls it on every input, but a device sync on a
    GPU, where the forward checks asynchronously instead. Call it yourself (on a batch, or once on the data) for
    a clear Python error on a GPU.

    Example:
        >>> import torch
        >>> check_token_ids(torch.tensor([[1, 96]]), 97)  # all below 97: nothing happens
        >>> check_token_ids(torch.tensor([[1, 97]]), 97)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: input_ids hold ids in [1, 97] but vocab_size=97: ...
    """
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids hold ids in [{low}, {high}] but vocab_size={vocab_size}: "
            "the tokenizer and the model config disagree"
        )


def _ids_checked_on_host(device: torch.device) -> bool:
    """Whether GPT.forward checks token ids with a host read on `device` (everywhere but CUDA, where it stalls)."""
    return device.type != "cuda"


def _ids_message(vocab_size: int) -> str:
    return (
        f"lmcore: input_ids hold a token id outside [0, vocab_size={vocab_size}): the tokenizer and the model disagree"
    )


class LMOutput(NamedTuple):
    logits: Tensor | None  # (B, T, vocab_size); None for a loss computed alone (ModelConfig.loss_logits "labelled")
    loss: Tensor | None  # mean cross-entropy over labels != -100, or None without labels


# ModelConfig.loss_logits "labelled": rows of logits alive at once (2048 x 151,936 fp32 logits are 1.2 GB).
LOSS_CHUNK_ROWS = 2048


def labelled_loss(hidden: Tensor, labels: Tensor, norm: nn.Module, lm_head: nn.Module) -> Tensor:
    """The mean cross-entropy over ``labels`` != -100 of the final ``hidden`` states (B, T, C), from the logits of
    the labelled positions alone, LOSS_CHUNK_ROWS rows at a time, each chunk's logits recomputed in the backward pass
    (torch.utils.checkpoint) rather than kept: what ``F.cross_entropy(lm_head(norm(hidden)), labels)`` gives (NaN
    without a label), without the (B, T, V) logits. Selecting the rows reads their count on the host; a compiled
    graph keeps every row instead (the unlabelled ones contribute nothing).

    Example:
        >>> norm, head = nn.LayerNorm(8), nn.Linear(8, 11, bias=False)
        >>> h, y = torch.randn(2, 5, 8), torch.randint(0, 11, (2, 5)); y[0, :3] = -100
        >>> whole = F.cross_entropy(head(norm(h)).flatten(0, 1), y.flatten(), ignore_index=-100)
        >>> torch.allclose(labelled_loss(h, y, norm, head), whole)
        True
    """
    hidden, labels = hidden.flatten(0, 1), labels.flatten().long()  # (N, C), (N,)
    if not torch.compiler.is_compiling():
        keep = labels != -100
        hidden, labels = hidden[keep], labels[keep]

    def chunk_loss(h: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(lm_head(norm(h)).float(), y, ignore_index=-100, reduction="sum")

    total = hidden.sum() * 0.0  # keeps the graph when no row is labelled (the loss is then NaN, as the mean's)
    for start in range(0, hidden.shape[0], LOSS_CHUNK_ROWS):
        rows = slice(start, start + LOSS_CHUNK_ROWS)
        total = total + checkpoint(chunk_loss, hidden[rows], labels[rows], use_reentrant=False)
    return total / (labels != -100).sum()


class KVCache:
    """Keys and values of every layer for the tokens seen so far, each (B, n_kv_head, T_cached, head_dim).

    Pass the same object to successive `GPT.forward(..., kv_cache=cache)` calls; each call appends.

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny")).eval()
        >>> ids = torch.randint(0, 97, (1, 6))
        >>> cache = KVCache(model.config.n_layer)
        >>> _ = model(ids[:, :5], kv_cache=cache)  # the prompt
        >>> next_logits = model(ids[:, 5:], kv_cache=cache).logits  # one new position over the 5 cached
        >>> len(cache), torch.allclose(next_logits[:, -1], model(ids).logits[:, -1], atol=1e-5)
        (6, True)
    """

    def __init__(self, n_layer: int) -> None:
        self.keys: list[Tensor | None] = [None] * n_layer
        self.values: list[Tensor | None] = [None] * n_layer

    def __len__(self) -> int:
        """The number of cached positions."""
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's (B, Hkv, T, D) keys/values to `layer` and return everything cached so far."""
        cached_k, cached_v = self.keys[layer], self.values[layer]
        if cached_k is not None and cached_v is not None:  # both None before the first update, both set after
            k = torch.cat([cached_k, k], dim=2)
            v = torch.cat([cached_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019); computed in fp32 so bf16 inputs keep their scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(config: ModelConfig) -> RMSNorm | nn.LayerNorm:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    # One of the two exists: the learnable log-slopes (a parameter) or the fixed slopes (a buffer: ALiBi's, or all
    # zeros with RoPE).
    log_slopes: nn.Parameter
    slopes: Tensor

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.n_kv_head is not None  # __post_init__ replaces None by n_head
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.backend = config.attention_backend
        self.checkpoint_core = config.checkpointing == "attention"
        self.rope = config.position == "rope"
        kv_dim = self.n_kv_head * self.head_dim
        qkv_bias = config.bias or config.qkv_bias
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        slopes = self.fixed_slopes()  # (H,)
        if config.learnable_slopes:
            # Log-parameterised so a slope stays positive (a negative one would favour distant tokens).
            self.log_slopes = nn.Parameter(slopes.log())
        else:
            # Not persistent: derived from n_head, so checkpoints do not carry it.
            self.register_buffer("slopes", slopes, persistent=False)

    def fixed_slopes(self) -> Tensor:
        """The slopes this layer's config fixes, (H,) fp32 on the CPU: ALiBi's, or zeros with RoPE (no bias)."""
        return torch.zeros(self.n_head) if self.rope else alibi_slopes(self.n_head).float()

    def head_slopes(self, device: torch.device | None = None) -> Tensor:
        """The per-head slopes (H,) in fp32 (on `device` when given), whatever dtype the module was cast to."""
        if hasattr(self, "log_slopes"):
            return self.log_slopes.float().exp()
        if self.slopes.dtype != torch.float32 or (device is not None and self.slopes.device != device):
            # model.to(bf16) (DeepSpeed bf16 does it) rounds buffers; 2^(-8h/n) loses ~0.4% in bf16, and the
            # fp32 model that later loads the weights would then see different slopes. A model built on the meta
            # device and loaded with `assign=True` (lmcore.from_hf) has none. Restore exact values once.
            self.slopes = self.fixed_slopes().to(device or self.slopes.device)
        return self.slopes

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, starts: Tensor | None = None) -> Tensor:
        return alibi_attention(q, k, v, slopes, causal=True, backend=self.backend, document_starts=starts)

    def _core(self, attend, *args: Tensor | int | None) -> Tensor:
        if self.checkpoint_core and self.training and torch.is_grad_enabled():
            # Recompute only the attention core in backward: its s^2 scores are most of the activations at long
            # context and the cheapest part of a layer to recompute.
            return checkpoint(attend, *args, use_reentrant=False)
        return attend(*args)

    def forward(
        self,
        x: Tensor,
        kv_cache: KVCache | None = None,
        documents: Packed | None = None,
        rotary: Rotary | None = None,
    ) -> Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        if rotary is not None:
            # Rotated before the cache stores the keys: cached keys keep the angle of their own position.
            q, k = apply_rope(q, *rotary), apply_rope(k, *rotary)
        slopes = self.head_slopes(x.device)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if kv_cache is not None:
            # Queries are the last T positions of the keys; alibi_attention aligns them to the end.
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, Hkv, T_cached + T, D)
        # With documents, attention stays inside each one: on the torch path the keys before each query's document
        # are masked, on the Triton path the rows are packed for the varlen kernels (inside alibi_attention).
        starts = None if documents is None else documents.starts
        y = self._core(self._attend, q, k, v, slopes, starts).transpose(1, 2)  # (B, T, H, D)
        return self.resid_dropout(self.o_proj(y.reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.d_ff is not None  # __post_init__ replaces None by the activation's default
        self.swiglu = config.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        up = self.up_proj(x)  # (B, T, d_ff)
        h = F.silu(self.gate_proj(x)) * up if self.swiglu else F.gelu(up)  # (B, T, d_ff)
        return self.dropout(self.down_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.self_attn = Attention(config, layer_idx)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        kv_cache: KVCache | None = None,
        documents: Packed | None = None,
        rotary: Rotary | None = None,
    ) -> Tensor:
        x = x + self.self_attn(self.attn_norm(x), kv_cache, documents, rotary)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model with ALiBi attention, or rotary positions (`ModelConfig.position="rope"`).

    Example:
        >>> model = GPT(ModelConfig.from_preset("tiny"))
        >>> ids = torch.randint(0, 97, (2, 16))
        >>> out = model(ids, labels=ids)  # labels already aligned: labels[t] is the target of position t
        >>> out.logits.shape, out.loss.ndim
        (torch.Size([2, 16, 97]), 0)
    """

    # Set by lmcore.lora.apply_lora (targets, r, alpha, dropout) while the model has adapters; absent otherwise.
    lora_settings: dict[str, Any]
    # Set by lmcore.from_hf: the Hugging Face architecture and config.json it came from (lmcore.hf_import.HFSource).
    hf_source: Any

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"GPT(config) needs a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        initialize(self, config.init)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, *, kv_cache: KVCache | None = None) -> LMOutput:
        """Logits for every position and, with `labels`, the mean cross-entropy over labels != -100 (with
        `config.loss_logits="labelled"`, the loss alone: :func:`labelled_loss`).

        `labels[t]` is the target of position t (the caller shifts). With `kv_cache`, `input_ids`
        continue the cached sequence and the cache is extended in place. With `config.document_separator`
        set and no `kv_cache`, attention stays inside the documents that the separator closes (with RoPE,
        positions restart at 0 in each document). With RoPE and a cache, positions continue from `len(kv_cache)`.
        """
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be integer (B, T), got {input_ids.dtype} {tuple(input_ids.shape)}")
        if input_ids.numel() and input_ids.device.type != "meta":
            if _ids_checked_on_host(input_ids.device) and not torch.compiler.is_compiling():
                check_token_ids(input_ids, self.config.vocab_size)
            else:
                # Reading the ids on the host would stall every step on a GPU and break a compiled graph; this assert
                # is an op of the graph: on a GPU it prints the message and surfaces at the next sync as a
                # device-side assert, in a graph compiled for the CPU it raises when the graph runs.
                in_range = ((input_ids >= 0) & (input_ids < self.config.vocab_size)).all()
                torch._assert_async(in_range, _ids_message(self.config.vocab_size))
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        documents = None
        separator = self.config.document_separator
        if separator is not None and kv_cache is None and input_ids.shape[1] > 0:
            # Once per forward, shared by every layer, with no host read: a compiled graph stays whole. (The Triton
            # path reads each layer's document offsets on the host inside its attention operator.)
            documents = Packed(document_starts(input_ids, separator))
        x = self.embed_dropout(self.embed_tokens(input_ids))  # (B, T, C)
        rotary = self._rotary(input_ids, kv_cache, documents, x.dtype) if self.config.position == "rope" else None
        checkpoint_blocks = self.config.checkpointing == "block" and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if checkpoint_blocks and kv_cache is None:
                x = checkpoint(layer, x, None, documents, rotary, use_reentrant=False)
            else:
                x = layer(x, kv_cache, documents, rotary)
        if labels is not None and self.config.loss_logits == "labelled":
            return LMOutput(None, labelled_loss(x, labels, self.norm, self.lm_head))
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().long(), ignore_index=-100)
        return LMOutput(logits, loss)

    def _rotary(
        self, input_ids: Tensor, kv_cache: KVCache | None, documents: Packed | None, dtype: torch.dtype
    ) -> Rotary:
        """cos/sin for every token, once per forward and shared by the layers; (1, T, D) or (B, T, D)."""
        B, T = input_ids.shape
        if documents is not None:
            positions = torch.arange(T, device=input_ids.device) - documents.starts  # (B, T), from 0 in each document
            # Only "dynamic" scaling reads the length (the longest document): a host read, on that setting alone.
            seq_len = int(positions.max()) + 1 if self.config.rope_scaling == "dynamic" else T
        else:
            start = 0 if kv_cache is None else len(kv_cache)  # read before layer 0 extends the cache
            positions = torch.arange(start, start + T, device=input_ids.device)[None]  # (1, T)
            seq_len = start + T
        return rotary_cos_sin(self.config, positions, seq_len, dtype)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at `seq_len` (default `config.context_length`): PaLM's 6*N + 12*L*H*Q*T.

        N is every parameter of the config except an untied input embedding (a lookup, not a matmul); the
        convention is spelled out in `lmcore.config.flops_per_token`. Computed from the config, so LoRA adapters
        added later are not counted.

        Example:
            >>> GPT(ModelConfig.from_preset("tiny")).flops_per_token()  # 6 * 106,304 + 12 * 2 * 4 * 16 * 32
            686976.0
        """
        return config_flops_per_token(self.config, seq_len)

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write `model.safetensors` and `config.json` into `directory` (created if needed); `state_dict` (the
        model's own when None) supplies the tensors, e.g. weights consolidated from several ranks."""
        from lmcore.pretrained import save_pretrained

        return save_pretrained(self, directory, state_dict)

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu") -> GPT:
        """Rebuild a model saved by `save_pretrained`; a weight/config mismatch raises ValueError naming the key."""
        from lmcore.pretrained import load_pretrained

        return load_pretrained(cls, directory, map_location)
