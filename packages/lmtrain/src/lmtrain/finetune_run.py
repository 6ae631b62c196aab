"""Fine-tuning: :func:`finetune`, the Python API, and `lmtrain finetune`, its command-line adapter.

A trained run's checkpoint (lmtrain.init_from) on chat data (lmtrain.chat): the whole model (``method="full"``),
LoRA adapters on chosen linear layers (``"lora"``, lmcore.lora), or LoRA over 4-bit NormalFloat base weights
(``"qlora"``, lmcore.qlora). It runs on trainloop's Trainer like `lmtrain train`: the same checkpoints, exact resume
(the data position included), SIGTERM and Ctrl-C handling, time budget, and torchrun or the deepspeed launcher.
The held-out samples (by hash) are evaluated as the mean loss over their response tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

METHODS = ("full", "lora", "qlora")
# Training settings of a fine-tune unless --set says otherwise: the fine-tuning recipe's cosine to 2e-6, a short
# warmup, no weight decay on the adapters.
FINETUNE_DEFAULTS: dict[str, Any] = dict(
    lr=2e-4, min_lr=2e-6, schedule="cosine", weight_decay=0.0, micro_batch=8, clip=1.0, log_every=10
)
FULL_LR = 5e-5  # the whole model moves: a smaller step than the adapters'
# Padding is the default batching: on this project's CPU, packed rows measured 0.83x-0.94x of padding's tokens/s
# (tools/bench_batching_step.py, tools/bench_finetune.py: cpu-small with LoRA r=16, rows of 256; docs/benchmarks.md),
# the varlen attention running one call per sample there. On a GPU the fused varlen kernel may turn it (not measured).


@dataclasses.dataclass(frozen=True)
class FinetuneRequest:
    """What the user asked: the flags of `lmtrain finetune`, or the arguments of :func:`finetune`."""

    source: str  # RUN[:best|latest|STEP]
    data: str  # JSONL chat samples
    out: str
    method: str = "lora"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    batching: str = "pad"  # the default: see the note above FinetuneRequest
    seq_len: int | None = None
    val_fraction: float = 0.1
    too_long: str = "truncate"
    max_steps: int | None = None
    time_budget_s: float | None = None
    resume: bool = False
    overwrite: bool = False
    gradient_checkpointing: bool = False
    engine: str = "torch"  # "torch" (one process, or DDP under torchrun) or "fsdp" (trainloop's fully_shard engine)
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LmtrainError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r <= 0:
            raise LmtrainError(f"--lora-r {self.lora_r!r}: expected a positive integer rank (e.g. 8)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise LmtrainError(f"--lora-dropout {self.lora_dropout!r}: expected a probability in [0, 1)")
        if not 0.0 < self.val_fraction < 1.0:
            raise LmtrainError(f"--val-fraction {self.val_fraction!r}: expected a fraction in (0, 1)")
        if self.engine not in ("torch", "fsdp"):
            raise LmtrainError(f"--engine {self.engine!r}: finetune runs on torch (one process or DDP) or fsdp")
        if self.engine == "fsdp" and self.method == "qlora":
            raise LmtrainError("--method qlora with --engine fsdp: the 4-bit base weights are not sharded by "
                               "fully_shard; use --engine torch for QLoRA, or --method lora with fsdp")  # fmt: skip
        if self.batching not in ("pack", "pad"):
            raise LmtrainError(f"--batching {self.batching!r}: expected pack or pad")
        if self.too_long not in ("truncate", "skip"):
            raise LmtrainError(f"--too-long {self.too_long!r}: expected truncate or skip")
        if self.resume and self.overwrite:
            raise LmtrainError("--resume continues a run and --overwrite deletes it: give one")
        if self.seq_len is not None and self.seq_len < 2:
            raise LmtrainError(f"--seq-len {self.seq_len}: expected a row length of at least 2 tokens")
        if self.max_steps is not None and self.max_steps < 1:
            raise LmtrainError(f"--max-steps {self.max_steps}: expected a positive number of steps")


def finetune(
    source: str | os.PathLike,
    data: str | os.PathLike,
    out: str | os.PathLike,
    *,
    method: str = "lora",
    lora_r: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    lora_targets: Sequence[str] = ("q", "k", "v", "o"),
    batching: str = "pad",
    seq_len: int | None = None,
    val_fraction: float = 0.1,
    max_steps: int | None = None,
    time_budget_s: float | None = None,
    resume: bool = False,
    overwrite: bool = False,
    gradient_checkpointing: bool = False,
    engine: str = "torch",
    overrides: Mapping[str, Any] | None = None,
    quiet: bool = False,
) -> Any:
    """Fine-tune the checkpoint ``source`` (``RUN[:best|latest|STEP]``) on the chat samples of ``data`` into the
    run directory ``out``, as `lmtrain finetune` does; returns the :class:`~lmtrain.train_run.RunSummary`.

    ``overrides`` sets TrainConfig fields (``{"lr": 1e-4, "eval_every": 20}``) and model fields that change no shape
    (``"dropout"``). Without ``max_steps`` the run trains one epoch of the training samples. ``engine`` is
    "torch" or "fsdp" (the frozen base and the adapters sharded over the ranks of a torchrun job).

    Example (`tiny_run`: 4 steps of the tiny preset; 40 instruction pairs from a little of the standard library):
        >>> import json, tempfile
        >>> from lmtrain.demo import tiny_run
        >>> from lmtrain.instructions import write_instructions
        >>> work = tempfile.TemporaryDirectory()
        >>> run = tiny_run(work.name)
        >>> _ = write_instructions(f"{work.name}/pairs.jsonl", max_pairs=40, max_chars=300)
        >>> summary = finetune(f"{run}:latest", f"{work.name}/pairs.jsonl", f"{work.name}/ft", max_steps=2,
        ...                    lora_r=4, seq_len=128, overrides={"micro_batch": 2, "eval_every": 2}, quiet=True)
        >>> recorded = json.loads((summary.run_dir / "run.json").read_text())["finetune"]; run_dir = summary.run_dir
        >>> summary.step, recorded["method"], recorded["lora"]["r"], (run_dir / "adapters.safetensors").exists()
        (2, 'lora', 4, True)
        >>> work.cleanup()
    """
    request = FinetuneRequest(
        source=str(source),
        data=str(data),
        out=str(out),
        method=method,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_targets=tuple(lora_targets),
        batching=batching,
        seq_len=seq_len,
        val_fraction=val_fraction,
        max_steps=max_steps,
        time_budget_s=time_budget_s,
        resume=resume,
        overwrite=overwrite,
        gradient_checkpointing=gradient_checkpointing,
        engine=engine,
        overrides=dict(overrides or {}),
    )
    return run_finetune_request(request, quiet=quiet)


def run_finetune_request(request: FinetuneRequest, *, quiet: bool = False) -> Any:
    """Fine-tune as ``request`` says (see :func:`finetune`)."""
    from lmtrain.run_lock import output_lock

    quieted = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with output_lock("finetune", request.out), quieted:
        return _run(request)


def _run(request: FinetuneRequest) -> Any:
    import torch

    import lmcore
    import tokbin
    from lmtrain import chat
    from lmtrain.init_from import load_init_weights, read_init_source
    from lmtrain.overrides import apply_overrides
    from lmtrain.recipes import DataConfig
    from lmtrain.run_files import RUN_FILE, TOKENIZER_FILE, load_tokenizer, read_run, write_json_atomic
    from lmtrain.train_run import SUMMARY_FILE, RunSummary, _copy_file, _plot, _world
    from trainloop import CheckpointError, CollectiveError, ConfigError, TrainConfig, Trainer
    from trainloop.checkpoint import refuse_outside_links
    from trainloop.distributed import teardown_distributed

    run_dir = Path(request.out)
    try:
        refuse_outside_links(run_dir)
    except CheckpointError as exc:
        raise LmtrainError(str(exc)) from None
    saved = read_run(run_dir) if request.resume and (run_dir / RUN_FILE).is_file() else None
    if saved is not None and "finetune" in saved:
        request = _request_as_saved(request, saved["finetune"])
    # Everything is read and checked before anything is written: the source, the data, the adapters' settings.
    samples = chat.read_samples(request.data)
    src_run = _source_dir(request.source)
    sp = load_tokenizer(src_run)
    tokenizer_sha = tokbin.file_sha256(src_run / TOKENIZER_FILE)
    source = read_init_source(request.source, tokenizer_sha, flag="--from")
    if request.method == "qlora":
        from lmcore.qlora import require_nf4

        try:
            require_nf4()
        except ImportError as exc:
            raise LmtrainError(str(exc)) from None
    template = chat.template_for(sp)
    model_cfg = lmcore.ModelConfig.from_dict(dict(source.model_config))
    seq_len = request.seq_len or int(source.run["data_config"]["seq_len"])
    train_values = dict(FINETUNE_DEFAULTS, lr=FULL_LR if request.method == "full" else FINETUNE_DEFAULTS["lr"])
    configs = apply_overrides(dict(request.overrides), {"model": model_cfg, "train": TrainConfig(**train_values)})
    model_cfg, train_cfg = configs["model"], configs["train"]
    if request.gradient_checkpointing:
        model_cfg = dataclasses.replace(model_cfg, checkpointing="block")
    eos, pad = sp.eos_id(), chat.pad_id_for(sp)
    if request.batching == "pack":
        # Attention inside each packed sample: every sample ends with EOS, which closes it (lmcore.documents).
        model_cfg = dataclasses.replace(model_cfg, document_separator=eos)
    train_samples, val_samples = chat.split_samples(samples, request.val_fraction)
    if not val_samples:
        raise LmtrainError(
            f"{request.data}: no sample fell in the held-out {request.val_fraction:.0%} (of "
            f"{len(samples)}): add samples or raise --val-fraction"
        )
    train_enc = chat.encode_samples(sp, template, train_samples, seq_len, request.too_long)
    val_enc = chat.encode_samples(sp, template, val_samples, seq_len, request.too_long)
    world = _world()
    batches = chat.ChatBatches(
        train_enc.samples,
        seq_len,
        train_cfg.micro_batch,
        pad,
        batching=request.batching,
        seed=train_cfg.seed,
        rank=world.rank,
        world_size=world.world_size,
    )
    per_epoch = batches.batches_per_epoch()
    if per_epoch == 0:
        raise LmtrainError(
            f"{request.data}: {len(train_enc.samples)} training sample(s) make fewer than one global "
            f"batch of {train_cfg.micro_batch * world.world_size} rows: add samples or lower "
            "micro_batch (--set micro_batch=N)"
        )
    steps = request.max_steps or (train_cfg.max_steps if "max_steps" in request.overrides else per_epoch)
    every = max(1, steps // 4)
    changes: dict[str, Any] = {"max_steps": steps, "time_budget_s": request.time_budget_s, "engine": request.engine}
    for name, value in (
        ("t_max", steps),
        ("warmup_steps", min(steps // 10, 100)),
        ("eval_every", every),
        ("save_every", every),
        ("log_every", min(train_cfg.log_every, steps)),
    ):
        if name not in request.overrides:
            changes[name] = value
    try:
        train_cfg = dataclasses.replace(train_cfg, **changes)
    except (ValueError, ConfigError) as exc:
        raise LmtrainError(str(exc)) from None

    torch.manual_seed(train_cfg.seed)
    model = lmcore.GPT(model_cfg)
    load_init_weights(model, source)
    lora_settings = None
    if request.method in ("lora", "qlora"):
        try:
            lmcore.apply_lora(model, request.lora_targets, request.lora_r, request.lora_alpha, request.lora_dropout)
        except ValueError as exc:
            raise LmtrainError(f"--lora-targets {','.join(request.lora_targets)}: {exc}") from None
        lora_settings = dict(model.lora_settings)
        if request.method == "qlora":
            from lmcore.qlora import quantize_frozen_linears

            quantize_frozen_linears(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = lmcore.n_params(model_cfg)
    record = {
        "from": source.record(),
        "data": str(Path(request.data).resolve()),
        "method": request.method,
        "lora": lora_settings,
        "batching": request.batching,
        "val_fraction": request.val_fraction,
        "too_long": request.too_long,
        "engine": request.engine,
        "seq_len": seq_len,
        "max_steps": request.max_steps,
        "samples": {
            "train": len(train_enc.samples),
            "val": len(val_enc.samples),
            "truncated": train_enc.truncated + val_enc.truncated,
            "skipped": train_enc.skipped + val_enc.skipped,
        },
        "trainable_params": trainable,
    }
    run_json = {
        "data": record["data"],
        "recipe": None,
        "schedule": "config",
        "model_config": model_cfg.to_dict(),
        "train_config": train_cfg.to_dict(),
        "data_config": dataclasses.asdict(DataConfig(seq_len=seq_len)),
        "eos_id": eos,
        "vocab_size": sp.get_piece_size(),
        "bytes_per_token": None,
        "n_params": total,
        "tokenizer_sha256": tokenizer_sha,
        "world_size": world.world_size,
        "cpu_threads": torch.get_num_threads(),
        "chat_template": template.to_json(),
        "finetune": record,
        "init_from": source.record(),
        "notes": [],
    }
    if world.rank == 0:
        lines = [
            f"from {source.run_dir} ({source.checkpoint.name}), method {request.method}"
            + (
                f": LoRA r={request.lora_r} alpha={request.lora_alpha:g} dropout={request.lora_dropout:g} on "
                f"{', '.join(lora_settings['targets'])}"
                if lora_settings
                else ""
            )
            + (", base weights in 4-bit NormalFloat (torchao NF4)" if request.method == "qlora" else ""),
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)",
            f"chat template: {template.name}"
            + ("" if template.name == "tokens" else " (the tokenizer has no chat tokens: plain-text role markers)"),
            f"{request.data}: {len(train_enc.samples)} training / {len(val_enc.samples)} held-out samples, "
            f"{train_enc.truncated + val_enc.truncated} truncated to {seq_len + 1} tokens, "
            f"{train_enc.skipped + val_enc.skipped} skipped ({request.too_long})",
            f"{request.batching}: {per_epoch} batches of {train_cfg.micro_batch} x {world.world_size} rank(s) per "
            f"epoch, {steps} steps, lr {train_cfg.lr:g}",
        ]
        for line in lines:
            print(f"lmtrain finetune: {line}", flush=True)
    del source
    eval_data = chat.eval_batches(
        val_enc.samples, train_cfg.micro_batch, pad, rank=world.rank, world_size=world.world_size
    )

    def on_ready() -> None:
        if world.rank == 0:
            _copy_file(src_run / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
            write_json_atomic(run_dir / RUN_FILE, saved or run_json)

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(
            model,
            train_cfg,
            batches,
            run_dir=run_dir,
            eval_data=eval_data,
            extra_state={"model_config": model_cfg.to_dict(), "tokenizer_sha256": tokenizer_sha, "finetune": record},
        )
        out = trainer.fit(resume=request.resume, overwrite=request.overwrite, on_ready=on_ready)
        # Sharded adapters (fsdp) are gathered on every rank (a collective) before rank 0 writes them.
        adapters = lmcore.lora_state(model) if lora_settings is not None else None
    except (ConfigError, CheckpointError) as exc:
        raise LmtrainError(str(exc)) from exc
    except CollectiveError as exc:
        raise LmtrainError(
            f"rank {world.rank} of {world.world_size} lost contact with the other ranks: "
            f"{str(exc).splitlines()[0][:300]}. Restart the job with --resume"
        ) from exc
    finally:
        teardown_distributed()
    if lora_settings is not None and world.rank == 0:
        from lmcore import save_lora

        save_lora(model, run_dir / "adapters.safetensors", tensors=adapters)
    summary = RunSummary(run_dir=run_dir, budget_plans=(), plan=None, **out)  # type: ignore[arg-type]
    if world.rank == 0:
        write_json_atomic(run_dir / SUMMARY_FILE, json.loads(json.dumps(summary.to_dict(), default=str)))
        _plot(run_dir)
        print(json.dumps({"summary": summary.to_dict(), "run_dir": str(run_dir)}, default=str), flush=True)
    return summary


def _source_dir(spec: str) -> Path:
    from lmtrain.init_from import parse_init_spec

    run_dir, _ = parse_init_spec(spec, "--from")
    if not run_dir.is_dir():
        raise LmtrainError(f"--from {spec}: {run_dir} is not a directory: expected a run written by `lmtrain train`")
    return run_dir


def _request_as_saved(request: FinetuneRequest, saved: Mapping[str, Any]) -> FinetuneRequest:
    """A resumed fine-tune keeps the settings it started with (run.json): method, adapters, batching, split."""
    lora = saved.get("lora") or {}
    return dataclasses.replace(
        request,
        method=saved.get("method", request.method),
        batching=saved.get("batching", request.batching),
        val_fraction=saved.get("val_fraction", request.val_fraction),
        seq_len=saved.get("seq_len", request.seq_len),
        too_long=saved.get("too_long", request.too_long),
        engine=saved.get("engine", request.engine),
        max_steps=saved.get("max_steps", request.max_steps),
        lora_r=lora.get("r", request.lora_r),
        lora_alpha=lora.get("alpha", request.lora_alpha),
        lora_dropout=lora.get("dropout", request.lora_dropout),
        lora_targets=tuple(lora.get("targets", request.lora_targets)),
    )


def run_finetune(args: argparse.Namespace) -> int:
    """The `lmtrain finetune` command: its flags as a :class:`FinetuneRequest`."""
    from lmtrain.overrides import parse_pairs

    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    request = FinetuneRequest(
        source=args.source,
        data=args.data,
        out=args.out,
        method=args.method,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
        batching=args.batching,
        seq_len=args.seq_len,
        val_fraction=args.val_fraction,
        too_long=args.too_long,
        max_steps=args.max_steps,
        time_budget_s=args.time_budget,
        resume=args.resume,
        overwrite=args.overwrite,
        gradient_checkpointing=args.gradient_checkpointing,
        engine=args.engine,
        overrides=dict(parse_pairs(args.overrides)),
    )
    run_finetune_request(request)
    return 0


def add_finetune_parser(sub: argparse._SubParsersAction) -> None:
    """The `lmtrain finetune` subcommand's flags."""
    from lmtrain.cli import add_gradient_checkpointing_flag

    p = sub.add_parser(
        "finetune",
        help="fine-tune a trained run on chat data (full, LoRA or QLoRA)",
        description="Start from a checkpoint of a trained run and train on JSONL chat samples ('messages' lists "
        "of {role, content}, or 'prompt'/'response'; plain or gzip), only the assistant turns carrying labels. "
        "Same checkpoints, --resume, SIGTERM handling, time budget and launchers as `train`.",
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="RUN[:best|latest|STEP]",
        help="the trained run to start from (default checkpoint: its best)",
    )
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="chat samples, one JSON object per line")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory of the fine-tune")
    p.add_argument("--method", default="lora", choices=METHODS, help="what trains (default lora)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha; the update is scaled alpha / r")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument(
        "--lora-targets",
        default="q,k,v,o",
        metavar="q,k,v,o",
        help="linear layers to adapt: q, k, v, o, gate, up, down, or mlp (default q,k,v,o)",
    )
    p.add_argument(
        "--batching",
        default="pad",
        choices=("pack", "pad"),
        help="pad each batch to its longest sample (default: it measured faster than packing on a CPU, "
        "docs/benchmarks.md), or pack samples into full rows with attention kept inside each",
    )
    p.add_argument("--seq-len", type=int, default=None, help="row length (default: the source run's)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="samples held out by hash (default 0.1)")
    p.add_argument(
        "--too-long",
        default="truncate",
        choices=("truncate", "skip"),
        help="a sample longer than a row: keep its first seq_len + 1 tokens (default) or leave it out",
    )
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: one epoch)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="bound on training time")
    restart = p.add_mutually_exclusive_group()
    restart.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint")
    restart.add_argument("--overwrite", action="store_true", help="start over in a RUN_DIR that holds checkpoints")
    add_gradient_checkpointing_flag(p)
    p.add_argument(
        "--engine",
        default="torch",
        choices=("torch", "fsdp"),
        help="torch (one process, or DDP under torchrun; the default) or fsdp (PyTorch's fully_shard: the frozen "
        "base and the adapters sharded over the ranks)",
    )
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="key=value",
        help="override a training field (lr, micro_batch, eval_every, precision...) or dropout",
    )
