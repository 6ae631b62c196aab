"""Every log_every steps one line and one metrics.jsonl record (TensorBoard, W&B when asked for); MFU by PaLM's formula.

TensorBoard and Weights & Biases are extras (``tensorboard``, ``wandb``): off unless the config asks for them, and
asked for but not installed, a one-line warning names the extra and the run goes on without them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from trainloop.checkpoint import open_guarded, open_new, refuse_linked
from trainloop.extras import MissingExtraError, import_extra

# Dense (no sparsity) bf16 tensor peak per device in TFLOP/s, matched against torch.cuda.get_device_name(): the
# vendor's rated peaks (H200/H100 SXM 989.5, A100 312, RTX 3090 71 with fp32 accumulate), not measured here; an MFU
# against a rated peak is an upper bound on what the step reaches. TrainConfig.peak_tflops overrides it.
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


def _optional_logger(module: str, extra: str, field: str) -> Any:
    """The logging library, or None after a one-line warning naming the extra that installs it."""
    try:
        return import_extra(module, extra, f"TrainConfig.{field}")
    except MissingExtraError as exc:
        print(f"trainloop: warning: {exc}; logging to metrics.jsonl only", file=sys.stderr, flush=True)
        return None


def _tensorboard_writer(run_dir: Path, resume_step: int | None) -> Any:
    if _optional_logger("tensorboard", "tensorboard", "tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    # TensorBoard hides events at steps >= purge_step from earlier files in the same directory: on resume those are
    # the abandoned steps after the checkpoint, on a fresh start every step of an earlier run.
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=0 if resume_step is None else resume_step + 1)


def _wandb_run(run_dir: Path, project: str) -> Any:
    wandb = _optional_logger("wandb", "wandb", "wandb_project")
    if wandb is None:
        return None
    # A resumed run becomes a new W&B run in the same group: W&B's own steps must only grow within one run.
    return wandb.init(project=project, dir=str(run_dir), name=run_dir.name, group=run_dir.name)


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a ``metrics.jsonl`` and the numbers (1-based) of the lines that are not a JSON object.

    A bad line is most often the last one, cut short when the process died mid-write (power loss, a full disk);
    blank lines are skipped silently.

    Example (a log whose last line was half-written):
        >>> import tempfile
        >>> from pathlib import Path
        >>> run = tempfile.TemporaryDirectory()
        >>> log = Path(run.name) / "metrics.jsonl"
        >>> _ = log.write_text('{"step": 10, "loss": 4.1}\\n\\n{"step": 20, "loss": 3.8}\\n{"step": 30, "lo')
        >>> records, bad = read_metrics(log)
        >>> [r["step"] for r in records], bad
        ([10, 20], [4])
        >>> run.cleanup()
    """
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                bad.append(number)
    return records, bad


def _describe_bad(bad: list[int]) -> str:
    if len(bad) == 1:
        return f"line {bad[0]}, not a complete JSON record (cut short by a crash or a full disk?)"
    return f"{len(bad)} lines that are not complete JSON records (lines {', '.join(map(str, bad[:5]))}" + (
        ", ...)" if len(bad) > 5 else ")"
    )


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a crash leaves the old or the new file."""
    refuse_linked(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover, or a link planted there: the link itself goes
    try:
        with open_new(tmp) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class MetricsLogger:
    """Writes ``metrics.jsonl`` (and TensorBoard / W&B scalars when asked for) on rank 0; other ranks log nothing."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        resume_step: int | None,
        wandb_project: str | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            # Records past the checkpoint belong to the abandoned future of the run: drop them.
            records, bad = read_metrics(self.path)
            if bad:
                print(f"trainloop: warning: {self.path}: ignored {_describe_bad(bad)}", file=sys.stderr, flush=True)
            kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= resume_step]
            _replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        # Appended to for the run, closed in close(); never through a symbolic or hard link.
        self._file = open_guarded(self.path, "a", append=True)
        if tensorboard:
            self.tb = _tensorboard_writer(run_dir, resume_step)
        if wandb_project is not None:
            self.wandb = _wandb_run(run_dir, wandb_project)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def format_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    parts.append(f"tok/s {record['tokens_per_s']:.0f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}% of {record['peak_tflops']:.0f} TFLOP/s")
    parts.append(f"mem {record['memory_bytes'] / 2**20:.0f} MiB ({record['memory_kind']})")
    if record.get("eta_s") is not None:
        parts.append(f"eta {short_duration(record['eta_s'])}")
    if record.get("skipped"):
        parts.append(f"SKIPPED ({record['skipped']} in a row)")
    return " | ".join(parts)


def short_duration(seconds: float) -> str:
    """A log line's duration: ``42s``, ``3m05s``, ``2h01m``.

    Example:
        >>> short_duration(42.4), short_duration(185), short_duration(7290)
        ('42s', '3m05s', '2h01m')
    """
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_eval(result: dict[str, Any]) -> str:
    """An evaluation result as a log line: the loss in nats per token, perplexity to 4 significant digits, the tokens
    scored as a count, bits per byte where known, the standard error of the mean loss.

    Example:
        >>> format_eval({"loss": 5.68606, "ppl": 294.6769, "tokens": 16384.0, "loss_se": 0.0213, "bpb": 2.41234})
        'loss 5.6861 nats/token (+-0.0213), ppl 294.7, 2.412 bits/byte, 16,384 tokens'
    """
    parts = [f"loss {result['loss']:.4f} nats/token" + (f" (+-{result['loss_se']:.4f})" if "loss_se" in result else "")]
    if "ppl" in result:
        parts.append(f"ppl {result['ppl']:.4g}" if result["ppl"] < 1e4 else f"ppl {result['ppl']:.3e}")
    if result.get("bpb") is not None:
        parts.append(f"{result['bpb']:.3f} bits/byte")
    if "tokens" in result:
        parts.append(f"{int(result['tokens']):,} tokens")
    known = {"loss", "loss_se", "ppl", "bpb", "tokens"}
    parts += [f"{k} {v:.4g}" for k, v in result.items() if k not in known and isinstance(v, (int, float))]
    return ", ".join(parts)
