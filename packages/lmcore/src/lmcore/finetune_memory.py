"""Fine-tuning memory per GPU: full fine-tuning, LoRA and QLoRA of one model config, on one GPU or under FSDP.

All three compute in bf16 (autocast, or bf16 weights) and step AdamW with fp32 states. Per GPU over N GPUs (N = 1:
one process, no sharding), for Psi parameters of which A are the adapters' (r x (in + out) per adapted linear):

  full   the whole model trains. One GPU: mixed-precision Adam as lmcore.memory counts it without ZeRO, 2 (bf16
         weights) + 2 (bf16 gradients) + 12 (fp32 master, Adam m and v) bytes per parameter. FSDP: its fp32 shards,
         16 Psi / N, with two blocks and the root gathered in bf16 and one block's gradient in flight
         (lmcore.memory.estimate_fsdp_memory).
  lora   the base frozen in bf16 (2 Psi, sharded: 2 Psi / N), adapters in fp32 with their fp32 gradients and Adam
         m and v (16 A / N); FSDP gathers two blocks and the root in bf16.
  qlora  the frozen linear layers in torchao's NF4 (lmcore.qlora: 4-bit codes, an int8 scale per 64 weights, an
         fp32 factor per block of int8 scales: 0.5159 bytes per weight for a 1536 x 1536 or 8960 x 1536 weight,
         measured with torchao 0.18 on the CPU and equal to :func:`nf4_bytes`), everything else (embeddings, norms,
         biases, an untied output head) in bf16, adapters as for lora. In flight: one linear layer's weight
         dequantized to bf16 (the largest), and under FSDP two blocks and the root gathered as they are stored.

Activations, per layer and token, in bytes (h = d_model, kv = the key/value width n_kv_head x head_dim, f = d_ff,
a = n_head; weights and activations in bf16, no dropout, a fine-tune's default), counting what autograd keeps for
the backward in lmcore's model:
  each of the two norms (lmcore's RMSNorm computes in fp32): its input in fp32 (4 h) and 1/rms (4), and where its
  weight trains the normalised input (2 h); the input of q, k and v, one tensor (2 h); the attention kernel's q, k,
  v, output and fp32 log-sum-exp (2 (h + 2 kv) + 2 h + 4 a: alibi-kernels' fused Triton path on a GPU, which keeps
  no scores and does not copy k and v for grouped heads); o's input (2 h, a copy of the kernel's output in
  (B, T, C) order); the input of gate and up (2 h); SwiGLU's gate output, silu(gate) and up (6 f), or GELU's input
  (2 f); down's input (2 f). Full fine-tuning keeps all of them: 24 h + 4 kv + 8 f + 4 a + 8 with SwiGLU. A frozen
  layer keeps no input for its weight (its gradient is not computed): LoRA on q, k, v, o drops both norms'
  normalised inputs, the input of gate and up and down's input (16 h + 4 kv + 6 f + 4 a + 8), and each adapter
  keeps its r-wide A output (2 r). `tests/test_finetune_memory.py` compares this with the bytes autograd saves in
  lmcore's model on the CPU (everything but the kernel, which runs only on a GPU): equal within 1%.
  Block checkpointing keeps each block's input (2 h per layer) and rebuilds one block at a time in the backward.
  The output layer: the final norm as above, the head's input where it trains (2 h), B x T x V logits in bf16 and
  their fp32 copy for the loss (6 bytes per element), the token ids (8). With the loss from the labelled positions
  alone (ModelConfig.loss_logits "labelled", `lmtrain finetune`'s default; lmcore.model.labelled_loss): the
  hidden states of the labelled positions (2 h, every position counted, an upper bound) and their labels (8), and
  the logits of one chunk of LOSS_CHUNK_ROWS positions with its final norm, rebuilt in the backward pass.

Not counted, as lmcore.memory leaves them out: the CUDA context, allocator fragmentation, the gradient of the
logits while the backward starts, communication buckets. :func:`estimate_finetune_memory` returns the figures;
the table of which method fits a card is `lmtrain doctor --from DIR`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcore.config import ModelConfig, n_params
from lmcore.lora import DEFAULT_TARGETS, resolve_targets
from lmcore.memory import block_parameters, estimate_fsdp_memory, estimate_memory
from lmcore.model import LOSS_CHUNK_ROWS
from lmcore.qlora import NF4_BLOCK, scaler_block_for

METHODS = ("full", "lora", "qlora")
CHECKPOINTING = ("off", "block")
BF16 = 2  # bytes of the compute dtype
ADAPTER_STATE = 16  # bytes per adapter parameter: fp32 weight, fp32 gradient, Adam m and v


@dataclass(frozen=True)
class FinetuneEstimate:
    """Bytes per GPU of one fine-tuning method at one micro-batch, sequence length and GPU count."""

    method: str
    world_size: int
    checkpointing: str
    n_params: int  # the model's parameters (the base's, without adapters)
    trainable: int  # what the optimizer steps: every parameter (full) or the adapters
    weights: int  # the weights as stored on this GPU: bf16, NF4, fp32 shards (full under FSDP), adapters in fp32
    gradients: int
    optimizer_states: int  # fp32 master weights (full, one GPU) and Adam's m and v
    gathered: int  # in flight: FSDP's gathered blocks and root, QLoRA's dequantized weight
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.gathered + self.activations

    def fits(self, gpu_memory_bytes: float) -> bool:
        return self.total <= gpu_memory_bytes


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one block, by lmcore's layer name.

    Example:
        >>> linear_shapes(ModelConfig.from_preset("tiny"))["k_proj"], "gate_proj" in linear_shapes(ModelConfig())
        ((64, 64), False)
    """
    assert config.n_kv_head is not None and config.d_ff is not None  # __post_init__ fills them
    h, kv, f = config.d_model, config.n_kv_head * config.head_dim, config.d_ff
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "up_proj": (h, f),
              "down_proj": (f, h)}  # fmt: skip
    if config.activation == "swiglu":
        shapes["gate_proj"] = (h, f)
    return shapes


def lora_parameters(config: ModelConfig, r: int, targets: tuple[str, ...] = DEFAULT_TARGETS) -> int:
    """The parameters lmcore.apply_lora adds: r x (in + out) for each targeted linear layer of each block.

    Example:
        >>> lora_parameters(ModelConfig.from_preset("tiny"), 8)  # 2 layers x 4 targets x 8 x (64 + 64)
        8192
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be a positive int, got {r!r}")
    shapes = linear_shapes(config)
    return config.n_layer * sum(r * (i + o) for name, (i, o) in shapes.items() if name in resolve_targets(targets))


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight of ``numel`` elements in torchao's NF4 as lmcore.qlora stores it: the 4-bit codes, an
    int8 scale per NF4_BLOCK weights, an fp32 factor per block of int8 scales (lmcore.qlora.scaler_block_for), the
    fp32 mean of the scales and the 16-entry fp32 code table.

    Example:
        >>> nf4_bytes(8960 * 1536) / (8960 * 1536)  # 0.5 + 1/64 + 4/(64 * 256) and the constants
        0.5158740815662203
    """
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + 4 * (blocks // scaler_block_for(numel)) + 4 + 4 * 16


def _nf4_linears(config: ModelConfig) -> list[int]:
    """The element counts of one block's linear weights that lmcore.qlora quantizes (whole blocks of 64)."""
    return [i * o for i, o in linear_shapes(config).values() if (i * o) % NF4_BLOCK == 0]


def attention_kernel_bytes(config: ModelConfig, tokens: int) -> int:
    """What the fused attention kernel keeps for its backward over ``tokens`` tokens: q, k, v, the output (bf16)
    and the fp32 log-sum-exp per query and head."""
    assert config.n_kv_head is not None
    h, kv = config.d_model, config.n_kv_head * config.head_dim
    return tokens * (BF16 * (2 * h + 2 * kv) + 4 * config.n_head)


def _norm_bytes(config: ModelConfig, weight_trains: bool) -> int:
    """Per token, what a norm keeps: lmcore's RMSNorm its fp32 input and 1/rms, and the normalised input where its
    weight trains; nn.LayerNorm its input, the mean and 1/std."""
    h = config.d_model
    if config.norm == "rmsnorm":
        return 4 * h + 4 + (BF16 * h if weight_trains else 0)
    return BF16 * h + 8


def activation_bytes_per_layer(config: ModelConfig, tokens: int, method: str,
                               targets: tuple[str, ...] = DEFAULT_TARGETS, r: int = 8) -> int:  # fmt: skip
    """What one block keeps for the backward over ``tokens`` tokens (module docstring), in bytes."""
    assert config.d_ff is not None
    h, f = config.d_model, config.d_ff
    full = method == "full"
    trains = set(linear_shapes(config)) if full else resolve_targets(targets)
    per_token = 2 * _norm_bytes(config, full)
    per_token += BF16 * h if trains & {"q_proj", "k_proj", "v_proj"} else 0
    per_token += BF16 * h if "o_proj" in trains else 0
    per_token += BF16 * h if trains & {"gate_proj", "up_proj"} else 0
    per_token += BF16 * (3 * f if config.activation == "swiglu" else f)  # gate, silu(gate), up; or GELU's input
    per_token += BF16 * f if "down_proj" in trains else 0
    per_token += 0 if full else BF16 * r * len(trains)  # each adapter's A output, which B's gradient needs
    return tokens * per_token + attention_kernel_bytes(config, tokens)


def finetune_activation_bytes(config: ModelConfig, micro_batch: int, seq_len: int, method: str,
                              checkpointing: str = "off", targets: tuple[str, ...] = DEFAULT_TARGETS,
                              r: int = 8, loss_logits: str | None = None) -> int:  # fmt: skip
    """Activation bytes of one forward kept for the backward (module docstring); ``loss_logits`` None is the
    config's.

    Example:
        >>> cfg = ModelConfig.from_preset("tiny")
        >>> [finetune_activation_bytes(cfg, 1, 32, m) for m in ("full", "lora")]
        [168640, 123328]
    """
    tokens = micro_batch * seq_len
    layer = activation_bytes_per_layer(config, tokens, method, targets, r)
    if checkpointing == "off":
        layers = config.n_layer * layer
    elif checkpointing == "block":
        layers = config.n_layer * BF16 * tokens * config.d_model + layer
    else:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    full = method == "full"
    final_norm = _norm_bytes(config, full) + (BF16 * config.d_model if full else 0)  # + the (tied) head's input
    # With a frozen embedding no gradient flows below the first block: its first norm keeps nothing.
    first_norm = 0 if full or checkpointing != "off" else _norm_bytes(config, False)
    if (loss_logits or config.loss_logits) == "labelled":
        chunk = min(tokens, LOSS_CHUNK_ROWS) * (final_norm + 6 * config.vocab_size)
        return layers + tokens * (BF16 * config.d_model + 8 - first_norm) + chunk
    return layers + tokens * (final_norm - first_norm + 6 * config.vocab_size + 8)


def estimate_finetune_memory(
    config: ModelConfig,
    method: str,
    micro_batch: int,
    seq_len: int,
    world_size: int = 1,
    checkpointing: str = "off",
    lora_r: int = 8,
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS,
    loss_logits: str | None = None,
) -> FinetuneEstimate:
    """Per-GPU memory of fine-tuning ``config`` by ``method`` (full, lora, qlora) at ``micro_batch`` x ``seq_len``
    tokens, on one GPU (``world_size`` 1) or under FSDP over ``world_size`` GPUs (module docstring); ``loss_logits``
    None is the config's ("labelled": what `lmtrain finetune` runs).

    Example (Qwen2-1.5B's shape):
        >>> cfg = ModelConfig(vocab_size=151936, n_layer=28, n_head=12, n_kv_head=2, d_model=1536, d_ff=8960,
        ...                   norm="rmsnorm", activation="swiglu", position="rope", bias=False, qkv_bias=True)
        >>> [round(estimate_finetune_memory(cfg, m, 1, 1024).total / 2**30, 1) for m in ("full", "lora", "qlora")]
        [26.7, 5.9, 4.1]
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    psi, n = n_params(config), world_size
    activations = finetune_activation_bytes(config, micro_batch, seq_len, method, checkpointing, lora_targets, lora_r,
                                            loss_logits)  # fmt: skip
    if method == "full":
        shape = (config, micro_batch, seq_len, "bf16")
        est = estimate_fsdp_memory(*shape, world_size=n) if n > 1 else estimate_memory(*shape, zero_stage=0)
        return FinetuneEstimate(method, n, checkpointing, psi, psi, est.parameters, est.gradients,
                                est.optimizer_states, est.gathered, activations)  # fmt: skip
    adapters = lora_parameters(config, lora_r, lora_targets)
    block, root = block_parameters(config)
    if method == "lora":
        base, block_b, root_b, in_flight = BF16 * psi, BF16 * block, BF16 * root, 0
    else:
        quantized = _nf4_linears(config)
        block_nf4 = sum(nf4_bytes(q) for q in quantized)
        block_b, root_b = block_nf4 + BF16 * (block - sum(quantized)), BF16 * root
        base = config.n_layer * block_b + root_b
        in_flight = BF16 * max(quantized, default=0)  # one weight dequantized for its matmul
    gathered = in_flight + (2 * block_b + root_b if n > 1 else 0)
    return FinetuneEstimate(method, n, checkpointing, psi, adapters, base // n + 4 * adapters // n,
                            4 * adapters // n, 8 * adapters // n, gathered, activations)  # fmt: skip
