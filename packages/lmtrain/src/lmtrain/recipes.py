"""What a user gets without flags: per-preset training defaults and the app's own data settings.

The numbers for `cpu-small` and `prepare`'s vocabulary size come from the TinyShakespeare benchmark runs recorded
in docs/benchmarks.md (`tools/bench_shakespeare.py`); the large presets carry the reference 1.3B recipe (AdamW peak
lr 3e-4, 500 warmup steps from 1e-6, cosine to 1e-6 over 10000 steps, bf16). A `--set key=value` overrides any of
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `lmtrain prepare --vocab-size` default (BPE): see docs/benchmarks.md for the sizes tried.
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_PRESET = "cpu-small"

# The GPU presets' schedule: the reference 1.3B recipe (4 nodes x 4 RTX 3090), a checkpoint every 1000 steps.
_GPU_RECIPE = dict(lr=3e-4, min_lr=1e-6, warmup_steps=500, schedule="cosine", t_max=10_000, max_steps=10_000,
                   precision="bf16", save_every=1000, log_every=10, eval_every=1000, eval_batches=50)  # fmt: skip

# TrainConfig fields per preset (only those that differ from trainloop's own defaults).
TRAIN_RECIPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=10,
        max_steps=200,
        micro_batch=8,
        log_every=10,
        eval_every=0,
        eval_batches=4,
        precision="fp32",
    ),  # fmt: skip
    # From the tuning runs in docs/benchmarks.md (tools/tune_cpu_small.py): a narrow model, a 128-token context and
    # small batches (more steps) did best; lr 3e-3 against 5e-3 is within their noise.
    "cpu-small": dict(
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=30,
        max_steps=100_000,
        micro_batch=16,
        grad_accum=1,
        precision="fp32",
        log_every=10,
        eval_every=0,
        eval_batches=8,
        save_every=0,
        weight_decay=0.1,
        clip=1.0,
    ),  # fmt: skip
    "125m": dict(_GPU_RECIPE, micro_batch=16, grad_accum=2),
    "350m": dict(_GPU_RECIPE, micro_batch=8, grad_accum=4),
    "760m": dict(_GPU_RECIPE, micro_batch=4, grad_accum=8),
    "1.3b": dict(_GPU_RECIPE, micro_batch=2, grad_accum=4),
    "2.7b": dict(_GPU_RECIPE, micro_batch=1, grad_accum=8),
}


@dataclass
class DataConfig:
    """The app's own settings between the token files and the trainer (overridable with `--set`).

    `seq_len=None` trains at the model's `context_length`. `sampler` is "random" (i.i.d. windows, nanoGPT's
    recipe) or "epoch" (every window once per epoch, shuffled). `cpu_threads=None` lets a single-process CPU run
    time a few steps with one thread and with all cores and keep the faster (on a shared 2-core machine one
    thread measured about 4x faster, tools/bench_threads.py); OMP_NUM_THREADS in the environment also skips the probe.

    Example:
        >>> DataConfig(seq_len=128).sampler
        'random'
    """

    seq_len: int | None = None
    sampler: str = "random"
    prefetch: int = 3
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ValueError(f"DataConfig.seq_len must be an int >= 2 or None, got {self.seq_len!r}")
        if self.sampler not in ("random", "epoch"):
            raise ValueError(f"DataConfig.sampler must be 'random' or 'epoch', got {self.sampler!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"DataConfig.prefetch must be an int >= 1, got {self.prefetch!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"DataConfig.cpu_threads must be an int >= 1 or None, got {self.cpu_threads!r}")


# DataConfig per preset.
DATA_RECIPES: dict[str, dict[str, Any]] = {
    "cpu-small": dict(seq_len=None),
}


def train_recipe(preset: str | None) -> dict[str, Any]:
    """TrainConfig field values for `preset` (empty for an unknown name or a config file).

    Example:
        >>> train_recipe("1.3b")["warmup_steps"]
        500
    """
    return dict(TRAIN_RECIPES.get(preset or "", {}))


def data_recipe(preset: str | None) -> dict[str, Any]:
    """DataConfig field values for `preset`."""
    return dict(DATA_RECIPES.get(preset or "", {}))
