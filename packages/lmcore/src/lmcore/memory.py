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

ZeRO-3's gathered working set (`gathered`, beyond DeepSpeed's estimator, which counts only the largest layer
gathered with its gradient): the parameters fetched ahead of use (`stage3_prefetch_bucket_size` elements, 5e7 by
default, in the compute dtype) and the parameters under `stage3_param_persistence_threshold` elements (1e5: norms,
biases), which stay whole on every GPU. FSDP's `gathered` is its unsharded blocks and root in flight (above).

Offload (DeepSpeed 0.19, `ZeroSettings` holds its knobs and defaults). `offload_optimizer` "cpu" moves the fp32
gradient partition, master weights and Adam's moments to host memory (16 Psi / N per process); with `pin_memory`
(the default) the master weights and gradients are page-locked, Adam's moments, which the optimizer allocates, are
not. `offload_optimizer` "nvme" (ZeRO-3 only) puts those 16 Psi / N on the drive; the host keeps `buffer_count` (4)
pinned swap buffers of the largest optimizer sub-group (at most `sub_group_size` elements, 1e9 by default), fp32:
with the default sub-group size that is the whole partition, 16 Psi / N again, so NVMe saves host memory only with
`sub_group_size` below Psi / N. `offload_param` (ZeRO-3 only) moves the 16-bit parameter partition (2 Psi / N) off
the GPU: to pinned host memory ("cpu"), or to the drive ("nvme") except `max_in_cpu` elements (1e9 by default:
DeepSpeed brings up to that many back to host memory for good, so set it to 0 to keep them on the drive), through
`buffer_count` (5) pinned buffers of `buffer_size` (1e8) elements. DeepSpeed's ZeRO-3 estimator with parameter
offload counts the GPU's share as the largest layer alone; this one adds the prefetch and persistent terms above.

Not counted: the CUDA context (about 0.3-1 GiB), allocator fragmentation, DeepSpeed's communication buckets
(reduce/allgather bucket sizes) and temporary buffers: keep a margin.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from lmcore.config import ModelConfig, n_params

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES = ("cpu", "nvme")
GIB = 1024**3


@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed's ZeRO settings that change memory, with DeepSpeed 0.19's defaults (the JSON names in comments).

    Example:
        >>> zero = ZeroSettings.from_ds_config({"stage3_prefetch_bucket_size": 1e7, "offload_param": {"max_in_cpu": 0}})
        >>> zero.prefetch_bucket_size, zero.max_in_cpu, zero.sub_group_size
        (10000000, 0, 1000000000)
    """

    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size (elements)
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold (elements)
    sub_group_size: int = 1_000_000_000  # sub_group_size (elements)
    pin_memory: bool = True  # offload_param / offload_optimizer .pin_memory
    param_buffer_count: int = 5  # offload_param.buffer_count
    param_buffer_size: int = 100_000_000  # offload_param.buffer_size (elements)
    max_in_cpu: int = 1_000_000_000  # offload_param.max_in_cpu (elements)
    optimizer_buffer_count: int = 4  # offload_optimizer.buffer_count

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "pin_memory":
                if not isinstance(value, bool):
                    raise ValueError(f"ZeroSettings.pin_memory must be true or false, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ZeroSettings.{name} must be an int >= 0, got {value!r}")

    @classmethod
    def from_ds_config(cls, zero_optimization: dict[str, Any]) -> ZeroSettings:
        """The settings a DeepSpeed config's ``zero_optimization`` block gives (its other keys are ignored)."""
        param, optimizer = (
            zero_optimization.get("offload_param") or {},
            zero_optimization.get("offload_optimizer") or {},
        )
        found: dict[str, Any] = {}
        for key, name, block in (
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size", zero_optimization),
            ("stage3_param_persistence_threshold", "persistence_threshold", zero_optimization),
            ("sub_group_size", "sub_group_size", zero_optimization),
            ("buffer_count", "param_buffer_count", param),
            ("buffer_size", "param_buffer_size", param),
            ("max_in_cpu", "max_in_cpu", param),
            ("buffer_count", "optimizer_buffer_count", optimizer),
        ):
            if isinstance(block.get(key), (int, float)) and not isinstance(block.get(key), bool):
                found[name] = int(block[key])
        pins = [b["pin_memory"] for b in (param, optimizer) if isinstance(b.get("pin_memory"), bool)]
        if pins:
            found["pin_memory"] = all(pins)
        return cls(**found)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, and host bytes per GPU process, for one training configuration."""

    n_params: int
    parameters: int  # GPU: the weights (16-bit, fp32 without DeepSpeed), partitioned under stage 3 (0 offloaded)
    gradients: int  # GPU: 16-bit gradients (full or partition) and the fp32 gradient partition
    optimizer_states: int  # GPU: fp32 master weights, Adam momentum and variance (0 when offloaded)
    activations: int  # GPU: what the forward keeps for the backward
    host_offload: int  # host, per GPU process: offloaded states and parameters, swap buffers (0 without offload)
    host_startup: int  # host, per GPU process: the fp32 model built on the CPU before it moves to the GPU
    gathered: int = 0  # GPU: parameters gathered whole in flight (ZeRO-3's prefetch and persistent ones, FSDP's)
    host_pinned: int = 0  # host, per GPU process: the page-locked part of host_offload
    nvme: int = 0  # NVMe drive, per GPU process: offloaded parameters and optimizer states

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        """Everything on the GPU: model states, the gathered working set and activations."""
        return self.model_states + self.gathered + self.activations

    def host_per_node(self, gpus_per_node: int) -> int:
        """Peak host memory of one node running `gpus_per_node` GPU processes: start-up copies or offload buffers."""
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
        return gpus_per_node * max(self.host_startup, self.host_offload)

    def nvme_per_node(self, gpus_per_node: int) -> int:
        """Bytes on the NVMe drive(s) of one node running `gpus_per_node` GPU processes."""
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
        return gpus_per_node * self.nvme

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


def persistent_parameters(config: ModelConfig, threshold: int = 100_000) -> int:
    """Elements of the parameters with at most `threshold` elements (ZeRO-3 keeps them whole on every GPU): norms,
    biases, learnable slopes. Counted on the model built on the meta device (no memory).

    Example:
        >>> persistent_parameters(ModelConfig.from_preset("2.7b"))  # per layer 2 norms (w, b), 6 biases; final norm
        1070080
    """
    return sum(n for n in _parameter_sizes(json.dumps(asdict(config), sort_keys=True)) if n <= threshold)


@functools.lru_cache(maxsize=16)
def _parameter_sizes(config_json: str) -> tuple[int, ...]:
    import torch

    from lmcore.model import GPT

    with torch.device("meta"):
        model = GPT(ModelConfig(**json.loads(config_json)))
    return tuple(p.numel() for p in model.parameters())


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
    GPUs; the accounting is in the module docstring. `parameters` holds the sharded fp32 weights, `gathered` what
    is in flight unsharded (two blocks and the root, one block's gradient), `gradients` the sharded fp32 gradients
    and, with accumulation, the unsharded fp32 gradients kept between syncs (none with `sync_every_micro_batch`,
    trainloop's `fsdp_sync_every_micro`: the gradients are reduce-scattered on every micro-batch instead).
    `cpu_offload` (FSDP2's `CPUOffloadPolicy`, which pins by default) moves the shards to the host.

    Example:
        >>> est = estimate_fsdp_memory(ModelConfig.from_preset("1.3b"), 2, 1024, "bf16", world_size=16,
        ...                            gradient_accumulation_steps=4)
        >>> round(est.model_states / 2**30, 2), round(est.gathered / 2**30, 2), round(est.total / 2**30, 2)  # GiB
        (5.93, 0.59, 10.08)
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
    host_offload = host_pinned = 0
    if cpu_offload:
        host_offload = sharded_params + sharded_grads + adam
        host_pinned = sharded_params + sharded_grads  # Adam's moments are the optimizer's own, not pinned
        sharded_params, sharded_grads, adam = 0, 0, 0
    return MemoryEstimate(
        n_params=psi,
        parameters=sharded_params,
        gradients=sharded_grads + accumulated,
        optimizer_states=adam,
        activations=activation_bytes(config, micro_batch, seq_len, precision, checkpointing, fused_attention),
        host_offload=host_offload,
        host_startup=4 * psi,
        gathered=in_flight + grad_in_flight,
        host_pinned=host_pinned,
    )


def estimate_memory(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    zero_stage: int = 0,
    world_size: int = 1,
    offload_optimizer: bool | str | None = False,
    activation_checkpointing: str | None = None,
    fused_attention: bool = True,
    gradient_accumulation_steps: int = 1,
    offload_param: str | None = None,
    zero: ZeroSettings | None = None,
) -> MemoryEstimate:
    """Per-GPU training memory of `config` under data parallelism with ZeRO `zero_stage` over `world_size` GPUs.

    `activation_checkpointing` is off / attention / block; None takes `config.checkpointing`. `fused_attention`
    (default: alibi-kernels' Triton path) keeps no attention scores; False counts them. `gradient_accumulation_steps`
    > 1 adds DeepSpeed's host accumulation buffers under offload. `offload_optimizer` is False/None, "cpu" (or True)
    or "nvme"; `offload_param` None, "cpu" or "nvme" (ZeRO-3); `zero` holds DeepSpeed's knobs (default: its defaults).

    Example:
        >>> est = estimate_memory(ModelConfig.from_preset("1.3b"), 2, 1024, "bf16", zero_stage=2, world_size=16)
        >>> round(est.total / 2**30, 2), round(est.activations / est.total, 2)  # GiB per GPU, the activations' share
        (7.26, 0.49)
        >>> big = estimate_memory(ModelConfig.from_preset("2.7b"), 1, 1024, "bf16", zero_stage=3, world_size=32,
        ...                       offload_optimizer="cpu", offload_param="nvme", zero=ZeroSettings(max_in_cpu=0))
        >>> [round(b / 2**30, 2) for b in (big.model_states, big.gathered, big.host_offload, big.nvme)]
        [0.31, 0.1, 2.14, 0.15]
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
    optimizer_device = "cpu" if offload_optimizer is True else (offload_optimizer or None)
    if optimizer_device not in (None, *OFFLOAD_DEVICES):
        raise ValueError(f"offload_optimizer must be False, True, 'cpu' or 'nvme', got {offload_optimizer!r}")
    if offload_param not in (None, *OFFLOAD_DEVICES):
        raise ValueError(f"offload_param must be None, 'cpu' or 'nvme', got {offload_param!r}")
    if optimizer_device and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload shards the optimizer first)")
    if optimizer_device == "nvme" and zero_stage != 3:
        raise ValueError("offload_optimizer='nvme' needs zero_stage 3 (ZeRO-1/2 offload the optimizer to CPU only)")
    if offload_param and zero_stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs zero_stage 3 (only ZeRO-3 partitions the parameters)")
    zero = ZeroSettings() if zero is None else zero
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
    host_offload = host_pinned = nvme = gathered = 0
    if zero_stage == 3:
        compute = 4 if precision == "fp32" else 2
        gathered = compute * (
            min(zero.prefetch_bucket_size, psi) + persistent_parameters(config, zero.persistence_threshold)
        )
        if offload_param:  # the 16-bit partition leaves the GPU
            partition, param_b = param_b, 0
            if offload_param == "cpu":
                host_offload += partition
                host_pinned += partition if zero.pin_memory else 0
            else:  # up to max_in_cpu elements stay in host memory for good; buffers pinned for the transfers
                elements = partition // compute
                in_cpu = min(zero.max_in_cpu, elements)
                buffers = zero.param_buffer_count * max(zero.param_buffer_size, largest_parameter(config) // n)
                host_offload += compute * (in_cpu + buffers)
                host_pinned += compute * buffers
                nvme += compute * (elements - in_cpu)
        if precision != "fp32":  # one parameter gathered in 16-bit, with its 16-bit gradient (DeepSpeed's term)
            param_b += 4 * largest_parameter(config)
    if optimizer_device:
        # The optimizer steps on the host: the fp32 gradient partition, the master weights and Adam's states move
        # there; stage 2 and 3 send each reduced gradient straight to it, stage 1 keeps the full 16-bit gradients.
        states = fp32_grads + master + adam
        fp32_grads, master, adam = 0, 0, 0
        half_grads = half_grads if zero_stage == 1 else 0
        if optimizer_device == "nvme":  # on the drive; the host holds the swap buffers of the largest sub-group
            nvme += states
            sub_group = min(zero.sub_group_size, psi // n)
            host_offload += zero.optimizer_buffer_count * 4 * sub_group
            host_pinned += zero.optimizer_buffer_count * 4 * sub_group
        else:
            host_offload += states
            host_pinned += (states - 8 * psi // n) if zero.pin_memory else 0  # Adam's moments: not pinned
        if zero_stage in (1, 2) and precision != "fp32":  # DeepSpeed 0.19 stage_1_and_2's pinned staging buffers
            staging = 2 * psi // n + 2 * largest_parameter(config)
            if gradient_accumulation_steps > 1:
                staging += 2 * psi // n
            host_offload += staging
            host_pinned += staging
    grad_b, optim_b = half_grads + fp32_grads, master + adam
    return MemoryEstimate(
        n_params=psi,
        parameters=param_b,
        gradients=grad_b,
        optimizer_states=optim_b,
        activations=activation_bytes(config, micro_batch, seq_len, precision, checkpointing, fused_attention),
        host_offload=host_offload,
        host_startup=4 * psi,
        gathered=gathered,
        host_pinned=host_pinned,
        nvme=nvme,
    )
