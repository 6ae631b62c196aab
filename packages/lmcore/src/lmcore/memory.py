"""Training memory per GPU: ZeRO's model-state accounting plus Korthikanti et al.'s activation formula.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1), for Psi parameters:
  mixed precision (bf16/fp16) Adam: 2 Psi (16-bit params) + 2 Psi (16-bit grads) + 12 Psi (fp32 master
  params, momentum, variance); fp32 Adam: 4 Psi + 4 Psi + 8 Psi. Stage 1 divides the optimizer states by
  the data-parallel world size N, stage 2 also the gradients, stage 3 also the parameters.
  `offload_optimizer` moves the (sharded) optimizer states to CPU memory (ZeRO-Offload).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
eq. 1 without tensor/sequence parallelism), for s = seq_len, b = micro_batch, h = d_model, a = n_head, L layers,
16-bit activations:
  off:       L * s*b*h * (34 + 5*a*s/h)     bytes  (the 5as/h term is the s^2 attention scores/softmax/dropout)
  attention: L * s*b*h * 34                 bytes  (selective recompute of the attention core;
                                                    a fused/flash kernel stores no s^2 term either)
  block:     L * 2*s*b*h + s*b*h*(34 + 5*a*s/h)   (each block keeps only its input; one block is
                                                    rematerialised at a time during backward)
  plus the output layer: b*s*V logits in the 16-bit compute dtype and their fp32 copy for the loss
  (6 bytes per element; 4 in fp32). fp32 training doubles the activation bytes.
Not counted: the CUDA context (about 0.3-1 GiB), allocator fragmentation, DeepSpeed's communication
buckets (reduce/allgather bucket sizes) and temporary buffers: keep a margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcore.config import ModelConfig, n_params

PRECISIONS = ("fp32", "bf16", "fp16")
GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (and optimizer bytes on CPU when offloaded) for one training configuration."""

    n_params: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    cpu_optimizer_states: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        """Everything on the GPU: model states plus activations."""
        return self.model_states + self.activations

    def fits(self, gpu_memory_bytes: int) -> bool:
        return self.total <= gpu_memory_bytes


def activation_bytes(
    config: ModelConfig, micro_batch: int, seq_len: int, precision: str = "bf16", checkpointing: str = "off"
) -> int:
    """Activation memory of one forward pass kept for backward (formula in the module docstring)."""
    s, b, h, a, n_layer = seq_len, micro_batch, config.d_model, config.n_head, config.n_layer
    full_layer = s * b * h * 34 + 5 * a * s * s * b  # s*b*h*(34 + 5as/h), exact in integers
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


def estimate_memory(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    zero_stage: int = 0,
    world_size: int = 1,
    offload_optimizer: bool = False,
    activation_checkpointing: str | None = None,
) -> MemoryEstimate:
    """Per-GPU training memory of `config` under data parallelism with ZeRO `zero_stage` over `world_size` GPUs.

    `activation_checkpointing` is off / attention / block; None takes `config.checkpointing`.

    Example:
        >>> est = estimate_memory(ModelConfig.from_preset("1.3b"), 2, 1024, "bf16", zero_stage=2, world_size=16)
        >>> round(est.total / 2**30, 1), round(est.activations / est.total, 2)  # GiB per GPU, the activations' share
        (10.7, 0.68)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload shards the optimizer first)")
    checkpointing = config.checkpointing if activation_checkpointing is None else activation_checkpointing

    psi = n_params(config)
    if precision == "fp32":
        param_b, grad_b, optim_b = 4 * psi, 4 * psi, 8 * psi  # fp32 weights, grads, Adam m and v
    else:
        param_b, grad_b, optim_b = 2 * psi, 2 * psi, 12 * psi  # 16-bit weights/grads; fp32 master, m, v
    n = world_size
    optim_b = optim_b // n if zero_stage >= 1 else optim_b
    grad_b = grad_b // n if zero_stage >= 2 else grad_b
    param_b = param_b // n if zero_stage >= 3 else param_b
    cpu_optim = optim_b if offload_optimizer else 0
    return MemoryEstimate(
        n_params=psi,
        parameters=param_b,
        gradients=grad_b,
        optimizer_states=0 if offload_optimizer else optim_b,
        activations=activation_bytes(config, micro_batch, seq_len, precision, checkpointing),
        cpu_optimizer_states=cpu_optim,
    )
