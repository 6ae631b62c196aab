"""`lmcore-estimate`: print per-GPU training memory for a preset under ZeRO stages and say whether it fits.

Example:
    lmcore-estimate --preset 1.3b --gpus 16 --gpus-per-node 4 --zero 0 2 --micro-batch 2 --seq-len 1024
"""

from __future__ import annotations

import argparse
import math
import sys

from lmcore.config import CHECKPOINTING, PRESETS, ModelConfig, flops_per_token
from lmcore.memory import GIB, OFFLOAD_DEVICES, PRECISIONS, MemoryEstimate, ZeroSettings, estimate_memory


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 and negatives are errors, never "the default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcore-estimate",
        description="Per-GPU training memory (ZeRO model-state accounting + activations), in GiB.",
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="override the preset's vocabulary size")
    p.add_argument("--gpus", type=positive_int, default=1, help="data-parallel world size (all nodes together)")
    p.add_argument(
        "--gpus-per-node", type=positive_int, default=None, help="GPU processes per node (default: all on one node)"
    )
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3], help="ZeRO stage(s)")
    p.add_argument(
        "--offload-optimizer",
        nargs="?",
        const="cpu",
        default=None,
        choices=OFFLOAD_DEVICES,
        help="optimizer states in CPU memory (ZeRO-Offload; the flag alone) or on NVMe (ZeRO-3)",
    )
    p.add_argument("--offload-param", default=None, choices=OFFLOAD_DEVICES, help="ZeRO-3 parameters on cpu or nvme")
    p.add_argument(
        "--max-in-cpu",
        type=int,
        default=ZeroSettings().max_in_cpu,
        help="offload_param.max_in_cpu: parameter elements DeepSpeed keeps in host memory under nvme (its default 1e9; "
        "0 keeps them all on the drive)",
    )
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per GPU per forward")
    p.add_argument(
        "--seq-len", type=positive_int, default=None, help="tokens per sequence (default: preset context length)"
    )
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--checkpointing", choices=CHECKPOINTING, default="off", help="activation checkpointing")
    p.add_argument(
        "--materialised-attention",
        action="store_true",
        help="count the (T x T) attention scores (default: the fused kernel, which keeps none)",
    )
    p.add_argument(
        "--grad-accum", type=positive_int, default=1, help="gradient accumulation steps (host buffers under offload)"
    )
    p.add_argument("--gpu-memory-gib", type=positive_float, default=24.0, help="memory of one GPU (24 for an RTX 3090)")
    return p


def format_table(estimates: dict[str, MemoryEstimate], gpu_memory_gib: float, gpus_per_node: int = 1) -> str:
    """A text table with one column per configuration, rows in GiB, and a fits line."""
    rows = [
        ("parameters", lambda e: e.parameters),
        ("gradients", lambda e: e.gradients),
        ("optimizer states", lambda e: e.optimizer_states),
        ("gathered", lambda e: e.gathered),
        ("activations", lambda e: e.activations),
        ("total per GPU", lambda e: e.total),
        ("host per process", lambda e: e.host_offload),
        ("host pinned", lambda e: e.host_pinned),
        ("host per node", lambda e: e.host_per_node(gpus_per_node)),
        ("NVMe per node", lambda e: e.nvme_per_node(gpus_per_node)),
    ]
    width = max(12, *(len(k) + 2 for k in estimates))
    lines = [f"{'GiB':<18}" + "".join(f"{k:>{width}}" for k in estimates)]
    for label, get in rows:
        lines.append(f"{label:<18}" + "".join(f"{get(e) / GIB:>{width}.2f}" for e in estimates.values()))
    verdicts = ["yes" if e.fits(int(gpu_memory_gib * GIB)) else "NO" for e in estimates.values()]
    lines.append(f"{f'fits {gpu_memory_gib:g} GiB':<18}" + "".join(f"{v:>{width}}" for v in verdicts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table; bad input exits with status 2 and one `lmcore-estimate: error: ...` line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    gpus_per_node = args.gpus if args.gpus_per_node is None else args.gpus_per_node
    if gpus_per_node > args.gpus or args.gpus % gpus_per_node:
        parser.error(f"--gpus-per-node {gpus_per_node} must divide --gpus {args.gpus} (GPUs of every node together)")
    if args.offload_optimizer and not any(args.zero):
        parser.error("--offload-optimizer needs a ZeRO stage >= 1 in --zero (ZeRO-Offload shards the optimizer first)")
    if (args.offload_param or args.offload_optimizer == "nvme") and args.zero != [3]:
        parser.error("--offload-param and --offload-optimizer nvme need --zero 3 alone (only ZeRO-3 offloads there)")
    overrides = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    try:
        config = ModelConfig.from_preset(args.preset, **overrides)
        seq_len = config.context_length if args.seq_len is None else args.seq_len
        estimates = {
            f"zero-{stage}": estimate_memory(
                config,
                args.micro_batch,
                seq_len,
                args.precision,
                zero_stage=stage,
                world_size=args.gpus,
                offload_optimizer=args.offload_optimizer if stage > 0 else None,
                offload_param=args.offload_param,
                zero=ZeroSettings(max_in_cpu=args.max_in_cpu),
                activation_checkpointing=args.checkpointing,
                fused_attention=not args.materialised_attention,
                gradient_accumulation_steps=args.grad_accum,
            )
            for stage in args.zero
        }
    except ValueError as exc:
        parser.error(str(exc))
    n = next(iter(estimates.values())).n_params
    print(
        f"{args.preset}: {n:,} parameters, {args.gpus} GPU(s), micro-batch {args.micro_batch} x {seq_len} tokens, "
        f"{args.precision}, checkpointing {args.checkpointing}, offload optimizer {args.offload_optimizer or 'no'}, "
        f"offload parameters {args.offload_param or 'no'}, "
        f"{'materialised' if args.materialised_attention else 'fused'} attention, {gpus_per_node} GPU(s) per node"
    )
    print(f"training FLOPs per token at {seq_len} tokens: {flops_per_token(config, seq_len):.4g} (PaLM: 6N + 12LHQT)")
    print(format_table(estimates, args.gpu_memory_gib, gpus_per_node))
    print(
        "host per node: the larger of each process's fp32 model built on the CPU (4 bytes per parameter) and the "
        "offloaded optimizer"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
