"""`lmtrain doctor --from DIR`: which of full fine-tuning, LoRA and QLoRA of a Hugging Face model fits a GPU, on one
card and under FSDP on N, from its config.json alone (no weights are read).

The figures are lmcore's (lmcore.finetune_memory); the settings are what `lmtrain finetune --from DIR` runs by
default (its micro-batch, its row length for a base, its LoRA rank and targets) unless --micro-batch and --seq-len
say otherwise. One GPU runs one process (the torch engine); N > 1 runs FSDP (`--engine fsdp`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

GiB = 2**30
METHODS = ("full", "lora", "qlora")
DEFAULT_WORLDS = (1, 2)


@dataclass(frozen=True)
class FitRow:
    """One method on one GPU count at one checkpointing setting, and whether it fits."""

    estimate: Any  # lmcore.FinetuneEstimate
    fits: bool

    @property
    def layout(self) -> str:
        return "one GPU" if self.estimate.world_size == 1 else f"FSDP x {self.estimate.world_size}"


def read_model_config(directory: str) -> tuple[str, Any]:
    """(architecture, lmcore ModelConfig) of the config.json in ``directory``; anything unreadable or unmapped is
    one LmtrainError naming the file, what was expected and the fix."""
    from lmcore.hf_import import CONFIG_NAME, read_hf_config
    from lmcore.hf_llama import HFImportError, architecture_of, config_from_hf

    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        what = "no such directory" if not Path(directory).is_dir() else f"{CONFIG_NAME} missing"
        raise LmtrainError(f"--from {directory}: {what}: expected a Hugging Face model directory with its "
                           f"{CONFIG_NAME} (the weights are not needed here); fix: pass the directory "
                           "save_pretrained wrote, or one holding its config.json")  # fmt: skip
    try:
        raw = read_hf_config(directory)
        return architecture_of(raw, str(path)), config_from_hf(raw, str(path))
    except HFImportError as exc:
        raise LmtrainError(f"--from {directory}: {exc}") from None
    except OSError as exc:
        raise LmtrainError(f"--from {directory}: {path} cannot be read ({exc.strerror}): expected a readable "
                           "config.json; fix its permissions") from None  # fmt: skip


def finetune_defaults(config: Any) -> tuple[int, int, int, tuple[str, ...]]:
    """(micro-batch, row length, LoRA rank, LoRA targets) that `lmtrain finetune --from DIR` uses by default."""
    from lmtrain.base_model import DEFAULT_SEQ_LEN
    from lmtrain.finetune_run import FINETUNE_DEFAULTS, FinetuneRequest

    seq_len = min(DEFAULT_SEQ_LEN, config.context_length)
    return int(FINETUNE_DEFAULTS["micro_batch"]), seq_len, FinetuneRequest.lora_r, FinetuneRequest.lora_targets


def fit_rows(config: Any, worlds: tuple[int, ...], micro_batch: int, seq_len: int, gpu_memory_gib: float,
             lora_r: int, lora_targets: tuple[str, ...]) -> list[FitRow]:  # fmt: skip
    """Each method on each GPU count without activation checkpointing and, where that does not fit, with block
    checkpointing (doctor_plan's margin: the estimate within GPU_MARGIN of the card)."""
    from lmcore import estimate_finetune_memory
    from lmtrain.doctor_plan import GPU_MARGIN

    limit = GPU_MARGIN * gpu_memory_gib * GiB
    rows = []
    for method in METHODS:
        for world in worlds:
            for checkpointing in ("off", "block"):
                est = estimate_finetune_memory(config, method, micro_batch, seq_len, world, checkpointing,
                                               lora_r=lora_r, lora_targets=lora_targets,
                                               loss_logits="labelled")  # fmt: skip
                rows.append(FitRow(est, est.total <= limit))
                if rows[-1].fits:
                    break
    return rows


def format_fit(rows: list[FitRow], header: list[str], gpu_memory_gib: float) -> str:
    """The table `doctor --from` prints, GiB throughout, with a verdict line per GPU count."""
    from lmcore.model import LOSS_CHUNK_ROWS
    from lmtrain.doctor_plan import GPU_MARGIN

    titles = ("weights", "grads+optim", "in flight", "activations", "total")
    lines = [*header, f"{'method':<8}{'layout':<11}{'checkpointing':<15}" + "".join(f"{t:>13}" for t in titles)
             + "  fits"]  # fmt: skip
    for row in rows:
        e = row.estimate
        figures = (e.weights, e.gradients + e.optimizer_states, e.gathered, e.activations, e.total)
        cells = "".join(f"{b / GiB:>13.2f}" for b in figures)
        lines.append(f"{e.method:<8}{row.layout:<11}{e.checkpointing:<15}{cells}  {'yes' if row.fits else 'no'}")
    for world in sorted({r.estimate.world_size for r in rows}):
        where = "one GPU" if world == 1 else f"{world} GPUs under FSDP (--engine fsdp)"
        fitting = {r.estimate.method: r.estimate for r in rows if r.estimate.world_size == world and r.fits}
        fit = [m + (" (with --gradient-checkpointing)" if e.checkpointing == "block" else "")
               for m, e in fitting.items()]  # fmt: skip
        missing = [m for m in METHODS if m not in fitting]
        lines.append(f"{where}: fits: {', '.join(fit) or 'none'}" + (f"; does not fit: {', '.join(missing)}"
                                                                      if missing else ""))  # fmt: skip
    lines.append(
        f"fits: the estimate within {GPU_MARGIN:.0%} of {gpu_memory_gib:g} GiB (the CUDA context, fragmentation and "
        "communication buckets are not in it); full: bf16 weights and gradients, fp32 master weights and AdamW "
        "states (16 bytes per parameter, FSDP: fp32 shards); lora: the base frozen in bf16, adapters and their "
        "AdamW states in fp32; qlora: the frozen linear layers in NF4 (0.516 bytes per weight), the rest in bf16; "
        "in flight: FSDP's gathered blocks, QLoRA's dequantized weight; activations: bf16, the fused attention "
        f"kernel of a GPU, the loss from the labelled positions' logits {LOSS_CHUNK_ROWS} rows at a time as finetune "
        "computes it (lmcore.finetune_memory)"
    )
    return "\n".join(lines)


def run_from(args: argparse.Namespace) -> int:
    """``doctor --from DIR``: print the table; 1 when no method fits on any GPU count."""
    import lmcore

    for flag, value in (("--preset", args.preset), ("--hostfile", args.hostfile), ("--data", args.data)):
        if value:
            raise LmtrainError(f"{flag} with --from: --from prints the fine-tuning table of a Hugging Face model "
                               f"only; run the {flag} checks without --from")  # fmt: skip
    architecture, config = read_model_config(args.source)
    micro_default, seq_default, lora_r, targets = finetune_defaults(config)
    micro_batch = args.micro_batch or micro_default
    seq_len = args.seq_len or seq_default
    worlds = DEFAULT_WORLDS if args.world is None else tuple(sorted({1, args.world}))
    rows = fit_rows(config, worlds, micro_batch, seq_len, args.gpu_memory, lora_r, targets)
    said = {"micro": "--micro-batch" if args.micro_batch else "finetune's default",
            "seq": "--seq-len" if args.seq_len else "finetune's default for a base"}  # fmt: skip
    mlp = "SwiGLU" if config.activation == "swiglu" else "GELU"
    header = [
        f"{architecture} from {Path(args.source) / 'config.json'}: {lmcore.n_params(config):,} parameters "
        f"({config.n_layer} layers, width {config.d_model}, {config.n_head} heads, {config.n_kv_head} key/value "
        f"heads, {mlp} width {config.d_ff}, vocab {config.vocab_size}, "
        f"{'tied' if config.tie_embeddings else 'untied'} embeddings)",
        f"micro-batch {micro_batch} ({said['micro']}) x {seq_len} tokens ({said['seq']}), bf16, "
        f"{args.gpu_memory:g} GiB per GPU; LoRA and QLoRA r={lora_r} on {', '.join(targets)} (finetune's defaults)",
    ]
    print(format_fit(rows, header, args.gpu_memory))
    return 0 if any(r.fits for r in rows) else 1
