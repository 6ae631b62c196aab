"""One line and one metrics.jsonl record every log_every steps; TensorBoard when installed; MFU by PaLM's formula."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

# Dense bf16 peak per device in TFLOP/s, matched against torch.cuda.get_device_name(); FACTS.md gives the sources.
PEAK_TFLOPS = {"H200": 990.0, "H100": 990.0, "A100": 312.0, "RTX 3090": 71.0}


def detect_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(model: torch.nn.Module, override: float | None) -> tuple[float, str]:
    """Training FLOPs per token and where the figure came from.

    The model may expose ``flops_per_token`` (PaLM: ``6*N + 12*L*H*Q*T``, attention included) as an attribute or
    method; otherwise ``6 * n_params`` (the model's ``n_params`` or a count of its parameters), which omits attention.
    """
    if override is not None:
        return float(override), "TrainConfig.flops_per_token"
    own = getattr(model, "flops_per_token", None)
    if own is not None:
        return float(own() if callable(own) else own), "model.flops_per_token"
    n = getattr(model, "n_params", None)
    n = n() if callable(n) else n
    if n is None:
        n = sum(p.numel() for p in model.parameters())
    return 6.0 * float(n), "6 * n_params (attention FLOPs not counted)"


def memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss), "rss"
    except ImportError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "max_rss"


def add_throughput(
    record: dict[str, Any], tokens_per_s: float, device: torch.device, flops: float, peak: float | None, world: int
) -> None:
    """Add tokens/s, memory and (when the peak is known) MFU = tokens/s x FLOPs/token / (peak x ranks)."""
    mem, kind = memory_bytes(device)
    record.update(tokens_per_s=tokens_per_s, memory_bytes=mem, memory_kind=kind)
    if peak:
        record["mfu"] = tokens_per_s * flops / (peak * 1e12 * world)
        record["peak_tflops"] = peak


class MetricsLogger:
    """Writes ``metrics.jsonl`` (and TensorBoard scalars) on rank 0; other ranks log nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int | None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            # Records past the checkpoint belong to the abandoned future of the run: drop them.
            kept = [
                ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self.tb is not None:
                self.tb.close()


def format_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    parts.append(f"tok/s {record['tokens_per_s']:.0f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}% of {record['peak_tflops']:.0f} TFLOP/s")
    parts.append(f"mem {record['memory_bytes'] / 2**20:.0f} MiB ({record['memory_kind']})")
    if record.get("skipped"):
        parts.append(f"SKIPPED ({record['skipped']} in a row)")
    return " | ".join(parts)
