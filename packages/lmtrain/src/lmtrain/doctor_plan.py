"""`lmtrain doctor --preset P --world N`: which of the ZeRO and FSDP configurations fits a card, and the one to use.

Each configuration's GPU, host, pinned and NVMe bytes come from lmcore's estimator (lmcore.memory), its network bytes
per step from the collectives it runs; the table lists them all and recommends one by :data:`RULE`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lmtrain.errors import LmtrainError

GiB = 2**30


GPU_MARGIN = 0.9  # a configuration fits when its estimate is within 90% of the card: the CUDA context,
# allocator fragmentation and communication buckets are not in the estimate (lmcore.memory)
# How the configurations are ranked: bytes over the network first, then how far the states travel to the host or
# the drive each step, then without activation checkpointing (no recomputation) before with.
OFFLOAD_RANK = {None: 0, "optimizer": 1, "cpu": 2, "nvme": 3}
RULE = (
    "the fitting configuration that sends the fewest bytes over the network per step, then the one that moves the "
    "least to the host or the drive (no offload, optimizer, parameters to cpu, to nvme), then without activation "
    "checkpointing"
)


@dataclass(frozen=True)
class Layout:
    """One way to lay the model states out over the GPUs (and the host, the drive); ``how`` says how to run it."""

    name: str
    engine: str  # "deepspeed" or "fsdp"
    how: str
    zero_stage: int = 0
    offload_optimizer: str | None = None
    offload_param: str | None = None
    cpu_offload: bool = False  # FSDP's CPUOffloadPolicy
    max_in_cpu: int | None = None  # DeepSpeed's offload_param.max_in_cpu (None: its default)

    @property
    def offload(self) -> str | None:
        """How far the states travel each step: None, "optimizer", "cpu" (parameters too) or "nvme"."""
        if self.offload_param or self.cpu_offload:
            return self.offload_param or "cpu"
        return "optimizer" if self.offload_optimizer else None


NVME_HOW = 'offload_param "nvme" with max_in_cpu 0, offload_optimizer "cpu" (tools/cluster-3090/ds_config_2.7b.json)'
LAYOUTS = (
    Layout("ZeRO-2", "deepspeed", '--deepspeed CONFIG with "stage": 2', 2),
    Layout("ZeRO-2 + optimizer offload", "deepspeed", "--deepspeed tools/cluster-3090/ds_config.json", 2, "cpu"),
    Layout("ZeRO-3", "deepspeed", '--deepspeed CONFIG with "stage": 3', 3),
    Layout("ZeRO-3 + parameter offload cpu", "deepspeed", 'offload_param and _optimizer "cpu"', 3, "cpu", "cpu"),
    Layout("ZeRO-3 + parameter offload nvme", "deepspeed", NVME_HOW, 3, "cpu", "nvme", max_in_cpu=0),
    Layout("FSDP", "fsdp", "--engine fsdp"),
    Layout("FSDP + CPU offload", "fsdp", "--engine fsdp --set fsdp_cpu_offload=true", cpu_offload=True),
)


@dataclass(frozen=True)
class PlanRow:
    """One configuration's estimate: GPU bytes, host, pinned and NVMe bytes per node, network bytes per step."""

    layout: Layout
    checkpointing: str
    gpu: int
    host_node: int
    pinned_node: int
    nvme_node: int
    network: int
    fits: bool

    def rank(self) -> tuple[int, int, int]:
        return self.network, OFFLOAD_RANK[self.layout.offload], int(self.checkpointing != "off")


def network_bytes(layout: Layout, n_params: int, world: int, grad_accum: int, precision: str = "bf16") -> int:
    """Bytes each GPU sends per optimizer step, ring collectives (each moves (N-1)/N of its size per rank).

    ZeRO-2 reduce-scatters the 16-bit gradients on every micro-batch (DeepSpeed communicates off the accumulation
    boundary from stage 2 on) and all-gathers the updated weights once; ZeRO-3 all-gathers the weights in the forward
    and again in the backward and reduce-scatters the gradients, on every micro-batch; trainloop's FSDP gathers the
    weights twice per micro-batch and reduce-scatters fp32 gradients once per step.

    Example:
        >>> zero2, zero3 = LAYOUTS[0], LAYOUTS[2]
        >>> [network_bytes(layout, 1000, 4, 16) for layout in (zero2, zero3)]
        [25500, 72000]
    """
    half = 4 if precision == "fp32" else 2
    size = half * n_params
    if layout.engine == "fsdp":
        total = grad_accum * 2 * size + 4 * n_params
    elif layout.zero_stage == 3:
        total = grad_accum * 3 * size
    else:
        total = (grad_accum + 1) * size
    return total * (world - 1) // world


def plan_layouts(
    preset: str, world: int, micro_batch: int | None, gpu_memory_gib: float, gpus_per_node: int = 4
) -> tuple[list[PlanRow], PlanRow | None, str]:
    """Every configuration of :data:`LAYOUTS` for ``preset``'s recipe (its accumulation, precision and context; its
    micro-batch unless ``micro_batch`` is given) on ``world`` GPUs of ``gpu_memory_gib`` each, without activation
    checkpointing and, where that does not fit, with block checkpointing; the one recommended by :data:`RULE` (None
    when none fits) and a line naming the run.

    Example:
        >>> rows, best, _ = plan_layouts("1.3b", 16, 2, 24.0)
        >>> best.layout.name, best.checkpointing, len(rows)
        ('ZeRO-2', 'off', 7)
    """
    import lmcore
    from lmcore.memory import ZeroSettings
    from lmtrain.recipes import recipe_named

    recipe = recipe_named(preset)
    config, train_cfg = recipe.model_config(), recipe.train_config()
    seq, accum, precision = config.context_length, train_cfg.grad_accum, train_cfg.precision
    micro_batch = train_cfg.micro_batch if micro_batch is None else micro_batch
    limit = GPU_MARGIN * gpu_memory_gib * GiB
    rows: list[PlanRow] = []
    for layout in LAYOUTS:
        for checkpointing in ("off", "block"):
            shape = dict(activation_checkpointing=checkpointing, gradient_accumulation_steps=accum, world_size=world)
            if layout.engine == "fsdp":
                est = lmcore.estimate_fsdp_memory(config, micro_batch, seq, precision, cpu_offload=layout.cpu_offload,
                                                  **shape)  # fmt: skip
            else:
                zero = ZeroSettings() if layout.max_in_cpu is None else ZeroSettings(max_in_cpu=layout.max_in_cpu)
                est = lmcore.estimate_memory(config, micro_batch, seq, precision, zero_stage=layout.zero_stage,
                                             offload_optimizer=layout.offload_optimizer,
                                             offload_param=layout.offload_param, zero=zero, **shape)  # fmt: skip
            network = network_bytes(layout, est.n_params, world, accum, precision)
            per_node = (est.host_per_node(gpus_per_node), gpus_per_node * est.host_pinned,
                        est.nvme_per_node(gpus_per_node))  # fmt: skip
            rows.append(PlanRow(layout, checkpointing, est.total, *per_node, network, est.total <= limit))
            if rows[-1].fits:  # checkpointing only where the configuration does not fit without it
                break
    best = min((r for r in rows if r.fits), key=PlanRow.rank, default=None)
    n = lmcore.n_params(config)
    header = (
        f"{preset} ({n:,} parameters), {world} GPUs ({gpus_per_node} per node), micro-batch {micro_batch} x {seq} "
        f"tokens, accumulation {accum} (the recipe's), {precision}, {gpu_memory_gib:g} GiB per GPU"
    )
    return rows, best, header


def format_plan(rows: list[PlanRow], best: PlanRow | None, header: str, gpu_memory_gib: float) -> str:
    """The table ``doctor --world`` prints (and docs/cluster-3090.md holds), GiB throughout."""
    titles = ("configuration", "checkpointing", "GPU", "host/node", "pinned/node", "NVMe/node", "network/step", "fits")
    width = max(len(r.layout.name) for r in rows) + 2
    lines = [header, f"{titles[0]:<{width}}{titles[1]:<15}" + "".join(f"{t:>13}" for t in titles[2:7]) + "  fits"]
    for r in rows:
        figures = (r.gpu, r.host_node, r.pinned_node, r.nvme_node, r.network)
        lines.append(f"{r.layout.name:<{width}}{r.checkpointing:<15}" + "".join(f"{b / GiB:>13.2f}" for b in figures)
                     + f"  {'yes' if r.fits else 'no'}")  # fmt: skip
    lines.append(
        f"fits: the GPU estimate within {GPU_MARGIN:.0%} of {gpu_memory_gib:g} GiB (the CUDA context, fragmentation "
        "and communication buckets are not in it); host: the larger of the fp32 models the processes build at "
        "start-up and the offloaded states and buffers; network: GiB each GPU sends per optimizer step"
    )
    if best is None:
        lines.append("recommended: none fits; use more GPUs, a smaller micro-batch or GPUs with more memory")
    else:
        ckpt = "" if best.checkpointing == "off" else f" with --set checkpointing={best.checkpointing}"
        lines.append(f"recommended: {best.layout.name}{ckpt} ({best.layout.how}); rule: {RULE}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """``doctor --preset P --world N``: print the table; 1 when no configuration fits."""
    if not args.preset:
        raise LmtrainError("--world needs --preset: lmtrain doctor --preset 1.3b --world 16 --micro-batch 2")
    if args.world % args.gpus_per_node:
        raise LmtrainError(
            f"--gpus-per-node {args.gpus_per_node} must divide --world {args.world} (every node runs as many GPUs)"
        )
    if args.hostfile or args.data:
        raise LmtrainError("--world prints the configuration table only: run --hostfile/--data checks without it")
    rows, best, header = plan_layouts(args.preset, args.world, args.micro_batch, args.gpu_memory, args.gpus_per_node)
    print(format_plan(rows, best, header, args.gpu_memory))
    return 0 if best is not None else 1
