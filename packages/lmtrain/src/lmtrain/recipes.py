"""What a user gets without flags: one table of named recipes, each a model, its training settings and its data
settings, and the app's own data settings (:class:`DataConfig`).

A recipe's model is the lmcore preset of the same shape; its training settings are the TrainConfig fields that
differ from trainloop's defaults. The numbers for `cpu-small` and `prepare`'s vocabulary size come from the
TinyShakespeare benchmark runs recorded in docs/benchmarks.md (`tools/bench_shakespeare.py`); the GPU recipes carry
the reference 1.3B recipe (AdamW peak lr 3e-4, 500 warmup steps from 1e-6, cosine to 1e-6 over 10000 steps, bf16).
A `--set key=value` (or `lmtrain.train(overrides=...)`) overrides any of them; `run.json` records the recipe's name
and the configs it resolved to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# `lmtrain prepare --vocab-size` default (BPE): see docs/benchmarks.md for the sizes tried.
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.1

Sampler = Literal["random", "epoch", "dynamic"]
SAMPLERS: tuple[Sampler, ...] = ("random", "epoch", "dynamic")


@dataclass
class DataConfig:
    """The app's own settings between the token files and the trainer (overridable with `--set`).

    `seq_len=None` trains at the model's `context_length`. `sampler` is "random" (i.i.d. windows, nanoGPT's
    recipe), "epoch" (every window once per epoch, shuffled) or "dynamic" (tokbin's DynamicLength: each batch's
    length picked from the document it starts at, seq_len / 4 for a short document, else seq_len, at a constant
    micro_batch x seq_len tokens per batch; `tokbin stats` prints the document lengths it is tuned from).
    `cpu_threads=None` lets a single-process CPU run time a few steps with one thread and with all cores and keep
    the faster (on a shared 2-core machine one thread measured about 4x faster, tools/bench_threads.py);
    OMP_NUM_THREADS in the environment also skips the probe.
    `cpu_matmul_probe` lets a CPU run route its fp32 GEMMs to oneDNN when a short probe at the model's shapes finds
    it faster and still fp32 (`lmcore.route_cpu_matmuls`); false keeps MKL, torch's default, unmeasured.

    Example:
        >>> DataConfig(seq_len=128).sampler
        'random'
    """

    seq_len: int | None = None
    sampler: Sampler = "random"
    prefetch: int = 3
    cpu_threads: int | None = None
    cpu_matmul_probe: bool = True  # fp32 GEMMs on oneDNN where a probe finds it faster and still fp32 (lmcore)

    def __post_init__(self) -> None:
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ValueError(f"DataConfig.seq_len must be an int >= 2 or None, got {self.seq_len!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"DataConfig.sampler must be 'random', 'epoch' or 'dynamic', got {self.sampler!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"DataConfig.prefetch must be an int >= 1, got {self.prefetch!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"DataConfig.cpu_threads must be an int >= 1 or None, got {self.cpu_threads!r}")
        if not isinstance(self.cpu_matmul_probe, bool):
            raise ValueError(f"DataConfig.cpu_matmul_probe must be true or false, got {self.cpu_matmul_probe!r}")


@dataclass(frozen=True)
class Recipe:
    """A named way to train: the model (ModelConfig fields), the training settings (TrainConfig fields that differ
    from trainloop's defaults) and the data settings (DataConfig fields).

    Example:
        >>> recipe = RECIPES["1.3b"]
        >>> recipe.model_config(vocab_size=32000).d_model, recipe.train_config().warmup_steps
        (2048, 500)
    """

    name: str
    model: Mapping[str, Any]
    train: Mapping[str, Any]
    data: Mapping[str, Any] = field(default_factory=dict)

    def model_config(self, vocab_size: int | None = None) -> Any:
        """The recipe's lmcore ModelConfig, with the tokenizer's vocabulary size when given."""
        from lmcore import ModelConfig

        return ModelConfig.from_dict({**self.model, **({} if vocab_size is None else {"vocab_size": vocab_size})})

    def train_config(self) -> Any:
        from trainloop import TrainConfig

        return TrainConfig.from_dict(dict(self.train))

    def data_config(self) -> DataConfig:
        return DataConfig(**self.data)

    def matches(self, model_config: Any) -> bool:
        """Whether ``model_config`` has this recipe's shape (layers, heads, width)."""
        return all(self.model.get(k) == getattr(model_config, k) for k in ("n_layer", "n_head", "d_model"))


def _table() -> dict[str, Recipe]:
    from lmcore import PRESETS

    # The GPU recipes' schedule: the reference 1.3B recipe (4 nodes x 4 RTX 3090), a checkpoint every 1000 steps.
    gpu = dict(lr=3e-4, min_lr=1e-6, warmup_steps=500, schedule="cosine", t_max=10_000, max_steps=10_000,
               precision="bf16", save_every=1000, log_every=10, eval_every=1000, eval_batches=50)  # fmt: skip
    recipes = [
        Recipe(
            "tiny",
            PRESETS["tiny"],
            dict(
                lr=3e-3,
                min_lr=3e-4,
                warmup_steps=10,
                max_steps=200,
                micro_batch=8,
                log_every=10,
                eval_every=0,
                eval_batches=4,
                precision="fp32",
            ),
        ),  # fmt: skip
        # From the tuning runs in docs/benchmarks.md (tools/tune_cpu_small.py): a narrow model, a 128-token
        # context and small batches (more steps) did best; lr 3e-3 against 5e-3 is within their noise.
        Recipe(
            "cpu-small",
            PRESETS["cpu-small"],
            dict(
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
            dict(seq_len=None),
        ),
        Recipe("125m", PRESETS["125m"], dict(gpu, micro_batch=16, grad_accum=2)),
        Recipe("350m", PRESETS["350m"], dict(gpu, micro_batch=8, grad_accum=4)),
        Recipe("760m", PRESETS["760m"], dict(gpu, micro_batch=4, grad_accum=8)),
        Recipe("1.3b", PRESETS["1.3b"], dict(gpu, micro_batch=2, grad_accum=4)),
        # The reference's next step: 32 GPUs, accumulation 16 (tools/cluster-3090/ds_config_2.7b.json), 1024 rows
        # (about 1M tokens) per step; `lmtrain doctor --preset 2.7b --world 32` says where it fits.
        Recipe("2.7b", PRESETS["2.7b"], dict(gpu, micro_batch=2, grad_accum=16)),
    ]
    return {r.name: r for r in recipes}


class _Recipes(Mapping[str, Recipe]):
    """The table, built on first use (it needs lmcore, which `lmtrain --help` should not import)."""

    def __init__(self) -> None:
        self._built: dict[str, Recipe] | None = None

    def _get(self) -> dict[str, Recipe]:
        if self._built is None:
            self._built = _table()
        return self._built

    def __getitem__(self, name: str) -> Recipe:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


RECIPES: Mapping[str, Recipe] = _Recipes()
DEFAULT_RECIPE = "cpu-small"  # `lmtrain train` without --preset or --model-config; what `lmtrain demo` trains
EXAMPLE_RECIPE = "tiny"  # the examples' and tests' few-second runs (lmtrain.examples.tiny_run)


def recipe_named(name: str) -> Recipe:
    """The recipe ``name``; an unknown name is a one-line error listing the known ones."""
    from lmtrain.errors import LmtrainError

    if name not in RECIPES:
        raise LmtrainError(f"--preset {name!r} is unknown; known presets: {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_matching(model_config: Any) -> Recipe | None:
    """The recipe whose model has the shape of ``model_config`` (a --model-config file then trains with that
    recipe's settings), or None."""
    return next((r for r in RECIPES.values() if r.matches(model_config)), None)
