"""Training memory per GPU and per node: DeepSpeed's ZeRO model-state accounting plus activations.

Model states, for Psi parameters, mixed precision (bf16/fp16) Adam under DeepSpeed ZeRO stage 1 or 2 over N GPUs,
as DeepSpeed 0.19's `estimate_zero2_model_states_mem_needs` counts them per GPU:
  2 Psi 16-bit parameters + 18 Psi / N, where 18 = 2 (16-bit gradient partition) + 4 (fp32 gradient partition)
  + 4 (fp32 master parameters) + 8 (Adam momentum and variance). Stage 1 keeps the full 16-bit gradients (2 Psi)
  instead of their partition. Stage 3 partitions the 16-bit parameters too, counts one gradient partition (4 Psi / N)
  and adds the largest parameter gathered in 16-bit with its gradient (4 bytes per element), as
  `estimate_zero3_model_states_mem_needs` does. Stage 0 counts
  plain mixed-precision Adam, 2 + 2 + 12 bytes per parameter; fp32 training 4 + 4 + 8.
  With `offload_optimizer` the GPU keeps only the 16-bit parameters (2 Psi, or 2 Psi / N and the gathered largest
  parameter under stage 3); gradients leave the GPU as they are reduced.

Host memory per node: each of the node's GPU processes first builds the model in fp32 on the host (4 Psi each:
lmtrain builds `GPT(config)` on the CPU before DeepSpeed moves it), then, under offload, holds its partition of the
optimizer in host memory. For stage 1 and 2, DeepSpeed 0.19 (`stage_1_and_2.py`) allocates per process: the fp32
master partition (4 Psi / N, pinned), the fp32 gradient partition (4 Psi / N, pinned), Adam's momentum and variance
(8 Psi / N), a 16-bit copy of the parameter partition for the upload (2 Psi / N, pinned), one 16-bit buffer the size
of the largest parameter (pinned), and with gradient accumulation a 16-bit accumulation buffer per parameter of the
partition (2 Psi / N, pinned). The peak per node is the larger of the start-up copies and the offload buffers.
DeepSpeed's estimator instead multiplies by an `additional_buffer_factor` of 1.5 and, for ZeRO-2 with offload,
counts 4 Psi per GPU of the whole job (`max(4 * total_gpus, 16) * Psi`) where only the node's own processes use its
memory; stated as such in `tests/test_memory.py`, which compares both.

Activations of a GPT layer without tensor/sequence parallelism (the tensors autograd keeps: 34 s*b*h bytes for
the projections, norms, GELU input and dropout masks; 5*a*s^2*b for the scores, their softmax and its dropout
mask), for s = seq_len, b = micro_batch, h = d_model, a = n_head, L layers, 16-bit:
  materialised attention: L * s*b*h * (34 + 5*a*s/h) bytes (5as/h: the s^2 scores, softmax and dropout mask)
  fused attention:        L * (s*b*h*34 + 4*a*s*b)  bytes (the kernel keeps no scores, only an fp32 log-sum-exp
                                                     per query and head; alibi-kernels' Triton path)
  checkpointing "attention" recomputes the attention core (no s^2 term either); "block" keeps each block's input
  (2*s*b*h per layer) and rematerialises one block at a time during backward.
  Plus the output layer: b*s*V logits in the 16-bit compute dtype and their fp32 copy for the loss (6 bytes per
  element; 4 in fp32). fp32 training doubles the activation bytes.
FSDP (PyTorch's `fully_shard` on each transformer block and on the root, trainloop's engine="fsdp"), per GPU over
N GPUs, AdamW in fp32: the sharded fp32 parameters (4 Psi / N), their fp32 gradients (4 Psi / N; bf16 compute
reduces them in fp32) and Adam's momentum and variance (8 Psi / N), 16 Psi / N in all. In flight: the unsharded
parameters of two blocks in the compute dtype (the one computing and the one prefetched; 2 bytes each in bf16, 4 in
fp32), the root's unsharded parameters (embeddings and final norm, kept gathered between forward and backward), and
in the backward one block's unsharded gradient in the compute dtype plus its fp32 copy for the reduce-scatter.
Accumulation without gradient sync (grad_accum > 1) keeps every block's unsharded gradient in fp32 until the step
that syncs: 4 Psi more, not divided by N (FSDP2's `unsharded_accumulated_grad`), unless the gradients are
reduce-scattered on every micro-batch. CPU offload moves the sharded
parameters, gradients and optimizer states to the host (16 Psi / N per process); only what is in flight stays.

Not counted: the CUDA context (about 0.3-1 GiB), allocator fragmentation, DeepSpeed's communication buckets
(reduce/allgather bucket sizes) and temporary buffers: keep a margin.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmcore.config import ModelConfig, n_params

PRECISIONS = ("fp32", "bf16", "fp16")
GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, and host bytes per GPU process, for one training configuration."""

    n_params: int
    parameters: int  # GPU: the weights (16-bit, fp32 without DeepSpeed), partitioned under stage 3
    gradients: int  # GPU: 16-bit gradients (full or partition) and the fp32 gradient partition
    optimizer_states: int  # GPU: fp32 master weights, Adam momentum and variance (0 when offloaded)
    activations: int  # GPU: what the forward keeps for the backward
    host_offload: int  # host, per GPU process: the offloaded optimizer's buffers (0 without offload)
    host_startup: int  # host, per GPU process: the fp32 model built on the CPU before it moves to the GPU

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        """Everything on the GPU: model states plus activations."""
        return self.model_states + self.activations

    def host_per_node(self, gpus_per_node: int) -> int:
        """Peak host memory of one node running `gpus_per_node` GPU processes: start-up copies or offload buffers."""
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
        return gpus_per_node * max(self.host_startup, self.host_offload)

    def fits(self, gpu_memory_bytes: int) -> bool:
        return self.total <= gpu_memory_bytes


def activation_bytes(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    checkpointing: str = "off",
    fused_attention: bool = True,
) -> int:
    """Activation memory of one forward pass kept for backward (formula in the module docstring).

    `fused_attention=False` counts the (s x s) score matrices a materialised attention keeps (Korthikanti's eq. 1).
    """
    s, b, h, a, n_layer = seq_len, micro_batch, config.d_model, config.n_head, config.n_layer
    materialised = s * b * h * 34 + 5 * a * s * s * b  # s*b*h*(34 + 5as/h), exact in integers
    fused = s * b * h * 34 + 4 * a * s * b  # the fp32 log-sum-exp instead of the scores
    full_layer = fused if fused_attention else materialised
    if checkpointing == "off":
        layers = n_layer * full_layer
    elif checkpointing == "attention":
        layers = n_layer * 34 * s * b * h
    elif checkpointing == "block":
        layers = n_layer * 2 * s * b * h + full_layer
    else:
        raise ValueError(f"checkpointing must be one of ('off', 'attention', 'block'), got {checkpointing!r}")
    if precision == "fp32":
        return 2 * layers + 4 * s * b * config.vocab_size
    return layers + 6 * s * b * config.vocab_size


def largest_parameter(config: ModelConfig) -> int:
    """Elements of the model's largest single parameter: the token embedding (vocab x d_model), or the MLP's."""
    assert config.d_ff is not None  # __post_init__ replaces None by the activation's default
    return max(config.vocab_size * config.d_model, config.d_model * config.d_ff)


def block_parameters(config: ModelConfig) -> tuple[int, int]:
    """(parameters of one transformer block, parameters outside the blocks: embeddings, final norm, untied head).

    Example:
        >>> block, root = block_parameters(ModelConfig.from_preset("tiny"))
        >>> 2 * block + root == n_params(ModelConfig.from_preset("tiny"))
        True
    """
    one = n_params(replace(config, n_layer=1))
    block = n_params(replace(config, n_layer=2)) - one
    return block, one - block


def estimate_fsdp_memory(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    world_size: int = 1,
    cpu_offload: bool = False,
    activation_checkpointing: str | None = None,
    fused_attention: bool = True,
    gradient_accumulation_steps: int = 1,
    sync_every_micro_batch: bool = False,
) -> MemoryEstimate:
    """Per-GPU training memory of `config` under FSDP (`fully_shard` per block and on the root) over `world_size`
    GPUs; the accounting is in the module docstring. `parameters` holds the sharded fp32 weights and what is in
    flight unsharded, `gradients` the sharded fp32 gradients, one block's unsharded gradient and, with accumulation,
    the unsharded fp32 gradients kept between syncs (none with `sync_every_micro_batch`, trainloop's
    `fsdp_sync_every_micro`: the gradients are reduce-scattered on every micro-batch instead).

    Example:
        >>> est = estimate_fsdp_memory(ModelConfig.from_preset("1.3b"), 2, 1024, "bf16", world_size=16,
        ...                            gradient_accumulation_steps=4)
        >>> round(est.model_states / 2**30, 2), round(est.total / 2**30, 2)  # GiB per GPU
        (6.52, 10.08)
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(
            f"precision must be 'fp32' or 'bf16' for FSDP (fp16 needs a sharded loss scaler), got {precision!r}"
        )
    for name, value in (
        ("world_size", world_size),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    checkpointing = config.checkpointing if activation_checkpointing is None else activation_checkpointing
    psi, n = n_params(config), world_size
    block, root = block_parameters(config)
    compute = 2 if precision == "bf16" else 4
    sharded_params, sharded_grads, adam = 4 * psi // n, 4 * psi // n, 8 * psi // n
    in_flight = compute * (2 * block + root)
    grad_in_flight = compute * block + (4 * block if precision == "bf16" else 0)
    accumulated = 4 * psi if gradient_accumulation_steps > 1 and not sync_every_micro_batch else 0
    host_offload = 0
    if cpu_offload:
        host_offload = sharded_params + sharded_grads + adam
        sharded_params, sharded_grads, adam = 0, 0, 0
    return MemoryEstimate(
        n_params=psi,
        parameters=sharded_params + in_flight,
        gradients=sharded_grads + grad_in_flight + accumulated,
        optimizer_states=adam,
        activations=activation_bytes(config, micro_batch, seq_len, precision, checkpointing, fused_attention),
        host_offload=host_offload,
        host_startup=4 * psi,
    )


def estimate_memory(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    zero_stage: int = 0,
    world_size: int = 1,
    offload_optimizer: bool = False,
    activation_checkpointing: str | None = None,
    fused_attention: bool = True,
    gradient_accumulation_steps: int = 1,
) -> MemoryEstimate:
    """Per-GPU training memory of `config` under data parallelism with ZeRO `zero_stage` over `world_size` GPUs.

    `activation_checkpointing` is off / attention / block; None takes `config.checkpointing`. `fused_attention`
    (default: alibi-kernels' Triton path) keeps no attention scores; False counts them. `gradient_accumulation_steps`
    > 1 adds DeepSpeed's host accumulation buffers under offload.

    Example:
        >>> est = estimate_memory(ModelConfig.from_preset("1.3b"), 2, 1024, "bf16", zero_stage=2, world_size=16)
        >>> round(est.total / 2**30, 2), round(est.activations / est.total, 2)  # GiB per GPU, the activations' share
        (7.26, 0.49)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    for name, value in (
        ("world_size", world_size),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload shards the optimizer first)")
    checkpointing = config.checkpointing if activation_checkpointing is None else activation_checkpointing

    psi, n = n_params(config), world_size
    shard = lambda stage: n if zero_stage >= stage else 1  # noqa: E731 (a divisor per ZeRO stage)
    if precision == "fp32":  # fp32 weights, gradients, Adam m and v
        param_b, half_grads, fp32_grads, master, adam = 4 * psi // shard(3), 0, 4 * psi // shard(2), 0, 8 * psi
    elif zero_stage == 0:  # the ZeRO paper's mixed-precision baseline: 2 + 2 + 12 bytes per parameter
        param_b, half_grads, fp32_grads, master, adam = 2 * psi, 2 * psi, 0, 4 * psi, 8 * psi
    else:
        param_b, half_grads, fp32_grads, master = 2 * psi // shard(3), 2 * psi // shard(2), 4 * psi // n, 4 * psi
        adam = 8 * psi
        if zero_stage == 3:  # one gradient partition (DeepSpeed's 18 = 2 + 4 + 4 + 8 for stage 3)
            half_grads = 0
    master, adam = master // shard(1), adam // shard(1)
    if zero_stage == 3 and precision != "fp32":  # one parameter gathered in 16-bit, with its 16-bit gradient
        param_b += 4 * largest_parameter(config)
    host_offload = 0
    if offload_optimizer:
        # The optimizer steps on the host: the fp32 gradient partition, the master weights and Adam's states move
        # there; stage 2 and 3 send each reduced gradient straight to it, stage 1 keeps the full 16-bit gradients.
        host_offload = fp32_grads + master + adam
        fp32_grads, master, adam = 0, 0, 0
        half_grads = half_grads if zero_stage == 1 else 0
        if zero_stage in (1, 2) and precision != "fp32":  # DeepSpeed 0.19 stage_1_and_2's pinned staging buffers
            host_offload += 2 * psi // n + 2 * largest_parameter(config)
            if gradient_accumulation_steps > 1:
                host_offload += 2 * psi // n
    grad_b, optim_b = half_grads + fp32_grads, master + adam
    return MemoryEstimate(
        n_params=psi,
        parameters=param_b,
        gradients=grad_b,
        optimizer_states=optim_b,
        activations=activation_bytes(config, micro_batch, seq_len, precision, checkpointing, fused_attention),
        host_offload=host_offload,
        host_startup=4 * psi,
    )
