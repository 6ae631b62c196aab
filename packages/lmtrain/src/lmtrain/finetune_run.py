"""Fine-tuning: :func:`finetune`, the Python API, and `lmtrain finetune`, its command-line adapter.

A trained run's checkpoint (lmtrain.init_from) on chat data (lmtrain.chat): the whole model (``method="full"``),
LoRA adapters on chosen linear layers (``"lora"``, lmcore.lora), or LoRA over 4-bit NormalFloat base weights
(``"qlora"``, lmcore.qlora). What is the recipe's own: the chat samples and their split, the model with its
adapters, what trains. Everything else is the scaffold every recipe shares (lmtrain.scaffold): the run directory,
the plan (time budget, CPU probes, engines, DeepSpeed, re-split on another world size), exact resume (the data
position included), SIGTERM and Ctrl-C, the live plot, gpumon and the closing block. The held-out samples (by hash)
are evaluated as the mean loss over their response tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.parsers import METHODS
from lmtrain.run_plan import Base, Verify, check_run_options
from lmtrain.run_record import RunRecord
from lmtrain.run_summary import RunSummary
from lmtrain.scaffold import Run, check_host_memory, finish, fit, open_run, route_matmuls, settle_cpu

# Training settings of a fine-tune unless --set says otherwise: the fine-tuning recipe's cosine to 2e-6, a short
# warmup, no weight decay on the adapters.
FINETUNE_DEFAULTS: dict[str, Any] = dict(
    lr=2e-4, min_lr=2e-6, schedule="cosine", weight_decay=0.0, micro_batch=8, clip=1.0, log_every=10
)
FULL_LR = 5e-5  # the whole model moves: a smaller step than the adapters'
FEW_STEPS = 50  # fewer optimizer steps than this is worth a warning (see _too_short)
# `--trainable NAME` (--method full): the parameter names each name stands for (fnmatch patterns); anything else is a
# comma-separated list of patterns of its own. Progressive unfreezing is a chain of runs, each --from the last.
TRAINABLE = {
    "all": ("*",),
    "attention": ("layers.*.self_attn.*",),
    "mlp": ("layers.*.mlp.*",),
    "norms": ("layers.*.attn_norm.*", "layers.*.mlp_norm.*", "norm.*"),
    "embeddings": ("embed_tokens.*", "lm_head.*"),
    "head": ("lm_head.*", "norm.*"),
}
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
    trainable: str | None = None  # --method full: what trains (lmtrain.finetune_run.TRAINABLE, or patterns); None: all
    max_steps: int | None = None
    time_budget_s: float | None = None
    resume: bool = False
    overwrite: bool = False
    verify: Verify = "sizes"
    deepspeed: str | Mapping[str, Any] | None = None
    engine: str | None = None  # torch (one process, or DDP under torchrun), fsdp or deepspeed
    gpumon: bool = False
    compile: bool = False
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    next_commands: bool = True  # the closing block lists the commands to run next (the demo prints its own)
    force: bool = False  # start even past the estimated host memory (lmtrain.scaffold.check_host_memory)

    def __post_init__(self) -> None:
        check_run_options(self)
        if self.method not in METHODS:
            raise LmtrainError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r <= 0:
            raise LmtrainError(f"--lora-r {self.lora_r!r}: expected a positive integer rank (e.g. 8)")
        if not (isinstance(self.lora_alpha, (int, float)) and 0 < self.lora_alpha < float("inf")):
            raise LmtrainError(f"--lora-alpha {self.lora_alpha!r}: expected a finite number > 0 (e.g. 16)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise LmtrainError(f"--lora-dropout {self.lora_dropout!r}: expected a probability in [0, 1)")
        if not 0.0 < self.val_fraction < 1.0:
            raise LmtrainError(f"--val-fraction {self.val_fraction!r}: expected a fraction in (0, 1)")
        engine = "deepspeed" if self.deepspeed is not None else self.engine
        if engine == "deepspeed" and self.method == "qlora":
            raise LmtrainError("--method qlora with --engine deepspeed: ZeRO does not shard the 4-bit base weights; "
                               "use --engine fsdp (or torch) for QLoRA, or --method lora with deepspeed")  # fmt: skip
        if self.batching not in ("pack", "pad"):
            raise LmtrainError(f"--batching {self.batching!r}: expected pack or pad")
        if self.too_long not in ("truncate", "skip"):
            raise LmtrainError(f"--too-long {self.too_long!r}: expected truncate or skip")
        if self.trainable is not None and self.method != "full":
            raise LmtrainError(f"--trainable {self.trainable}: chooses what --method full trains; LoRA trains its "
                               "adapters on --lora-targets: drop --trainable or use --method full")  # fmt: skip
        if self.seq_len is not None and self.seq_len < 2:
            raise LmtrainError(f"--seq-len {self.seq_len}: expected a row length of at least 2 tokens")


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
    trainable: str | None = None,
    batching: str = "pad",
    seq_len: int | None = None,
    val_fraction: float = 0.1,
    max_steps: int | None = None,
    time_budget_s: float | None = None,
    resume: bool = False,
    overwrite: bool = False,
    verify: Verify = "sizes",
    gradient_checkpointing: bool = False,
    engine: str | None = None,
    deepspeed: str | os.PathLike | Mapping[str, Any] | None = None,
    gpumon: bool = False,
    compile: bool = False,
    overrides: Mapping[str, Any] | None = None,
    quiet: bool = False,
) -> RunSummary:
    """Fine-tune the checkpoint ``source`` (``RUN[:best|latest|STEP]``) on the chat samples of ``data`` into the
    run directory ``out``, as `lmtrain finetune` does; returns the :class:`~lmtrain.run_summary.RunSummary`.

    ``overrides`` sets TrainConfig fields (``{"lr": 1e-4, "eval_every": 20}``) and model fields that change no shape
    (``"dropout"``). Without ``max_steps`` the run trains one epoch of the training samples, or with
    ``time_budget_s`` as many steps as the budget allows, its warmup and decay sized to the budget. ``engine`` is
    "torch", "fsdp" (the frozen base and the adapters sharded over the ranks of a torchrun job) or "deepspeed" (with
    ``deepspeed``, a DeepSpeed JSON file or dict); the other arguments are `lmtrain.train`'s.

    Example (`tiny_run`: 4 steps of the tiny preset; 40 instruction pairs from a little of the standard library; half
    held out, since the pairs, and so which of them the hash split holds out, differ between Pythons: a tenth held
    out none of them on 3.10 and 3.13):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_run
        >>> from lmtrain.instructions import write_instructions
        >>> from lmtrain.run_record import read_run_record
        >>> work = tempfile.TemporaryDirectory()
        >>> run = tiny_run(work.name)
        >>> _ = write_instructions(f"{work.name}/pairs.jsonl", max_pairs=40, max_chars=300)
        >>> summary = finetune(f"{run}:latest", f"{work.name}/pairs.jsonl", f"{work.name}/ft", max_steps=2,
        ...                    lora_r=4, seq_len=128, val_fraction=0.5, overrides={"micro_batch": 2, "eval_every": 2},
        ...                    quiet=True)
        >>> recorded = read_run_record(summary.run_dir).finetune
        >>> summary.step, recorded["method"], recorded["lora"]["r"], (summary.run_dir / "adapters.safetensors").exists()
        (2, 'lora', 4, True)
        >>> work.cleanup()
    """
    values = dict(overrides or {})
    if gradient_checkpointing:
        values["model.checkpointing"] = "block"
    request = FinetuneRequest(
        source=str(source), data=str(data), out=str(out), method=method, lora_r=lora_r, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, lora_targets=tuple(lora_targets), trainable=trainable, batching=batching,
        seq_len=seq_len,
        val_fraction=val_fraction, max_steps=max_steps, time_budget_s=time_budget_s, resume=resume,
        overwrite=overwrite, verify=verify, engine=engine, gpumon=gpumon, compile=compile, overrides=values,
        deepspeed=deepspeed if isinstance(deepspeed, Mapping) or deepspeed is None else str(deepspeed),
    )  # fmt: skip
    return run_finetune_request(request, quiet=quiet)


def run_finetune_request(request: FinetuneRequest, *, quiet: bool = False, as_json: bool = False) -> RunSummary:
    """Fine-tune as ``request`` says (see :func:`finetune`)."""
    with open_run("finetune", request, quiet=quiet) as run:
        return _run(run, request, as_json)


@dataclasses.dataclass(frozen=True)
class _Start:
    """What a fine-tune starts from, whichever kind: a checkpoint of an lmtrain run (lmtrain.init_from) or a Hugging
    Face base model directory (lmtrain.base_model); everything the recipe needs of it."""

    source: Any  # InitSource | BaseSource
    encode: Any  # turns -> (ids, labels)
    pad: int
    eos: int | None
    vocab_size: int
    tokenizer_sha256: str
    files: Mapping[str, Path]  # the tokenizer files the run keeps
    template: Any  # lmtrain.chat.ChatTemplate of a run, None for a base (its own template, in its files)
    seq_len: int  # the row length unless --seq-len
    recipe: str | None
    recorded: RunRecord | None  # the source run's CPU choices (lmtrain.probes)
    base: Mapping[str, Any] | None  # lmcore HFSource.to_dict() of a base
    label: str


def _start(request: FinetuneRequest) -> _Start:
    from lmtrain import base_model, chat
    from lmtrain.init_from import read_init_source
    from lmtrain.run_files import TOKENIZER_FILE, load_tokenizer

    src = _source_dir(request.source)
    if base_model.is_base_dir(src):
        if request.batching == "pack":
            raise LmtrainError(f"--from {request.source}: --batching pack keeps attention inside each sample by its "
                               "EOS, which a base model's chat template does not end every sample with: use "
                               "--batching pad")  # fmt: skip
        base = base_model.read_base(request.source)
        tok = base.tokenizer
        seq_len = min(base_model.DEFAULT_SEQ_LEN, int(base.model_config["context_length"]))
        return _Start(base, base_model.chat_encoder(tok, str(base.directory)), base_model.pad_id(tok), tok.eos_id,
                      tok.vocab_size, base.tokenizer_sha256, base.files(), None, seq_len, None, None,
                      base.hf_source(), f"{base.directory} ({base.architecture})")  # fmt: skip
    import tokbin

    sp = load_tokenizer(src)
    sha = tokbin.file_sha256(src / TOKENIZER_FILE)
    source = read_init_source(request.source, sha, flag="--from", verify=request.verify)
    template = chat.template_for(sp)
    return _Start(source, lambda turns: chat.encode_turns(sp, template, turns), chat.pad_id_for(sp), sp.eos_id(),
                  sp.get_piece_size(), sha, {TOKENIZER_FILE: src / TOKENIZER_FILE}, template, source.run.seq_len,
                  source.run.recipe, source.run, None,
                  f"{source.run_dir} ({source.checkpoint.name})")  # fmt: skip


def _run(run: Run, request: FinetuneRequest, as_json: bool) -> RunSummary:
    import torch

    import lmcore
    from lmtrain import chat
    from lmtrain.probes import ProbeCache
    from lmtrain.run_plan import settle

    saved = run.saved
    if saved is not None and saved.finetune is not None:
        request = _request_as_saved(request, saved.finetune)
    # Everything is read and checked before anything is written: the source, the data, the adapters' settings.
    samples = chat.read_samples(request.data)
    start = _start(request)
    if request.method == "qlora":
        from lmcore.qlora import require_nf4

        try:
            require_nf4()
        except ImportError as exc:
            raise LmtrainError(str(exc)) from None
    seq_len = request.seq_len or start.seq_len
    train_samples, val_samples = chat.split_samples(samples, request.val_fraction)
    if not val_samples:
        raise LmtrainError(f"{request.data}: no sample fell in the held-out {request.val_fraction:.0%} (of "
                           f"{len(samples)}): add samples or raise --val-fraction")  # fmt: skip
    train_enc = chat.encode_samples_with(start.encode, train_samples, seq_len, request.too_long)
    val_enc = chat.encode_samples_with(start.encode, val_samples, seq_len, request.too_long)

    def batches(train_cfg: Any, world_size: int, rank: int = 0) -> chat.ChatBatches:
        return chat.ChatBatches(train_enc.samples, seq_len, train_cfg.micro_batch, start.pad, batching=request.batching,
                                seed=train_cfg.seed, rank=rank, world_size=world_size)  # fmt: skip

    base = _base(request, start, saved, seq_len, lambda cfg: batches(cfg, run.world.world_size))
    recorded, cache = saved or start.recorded, ProbeCache()
    draft = settle(request, base, run.world, saved)
    frozen = lmcore.n_params(draft.model)
    if request.method == "full":
        check_host_memory(run, draft)  # before a probe builds the model
    else:
        check_host_memory(run, draft, trainable=_lora_parameters(draft.model, request), frozen=frozen)
    plan = settle_cpu(run, lambda world: settle(request, base, world, saved),
                      lambda p: _model(p, request), recorded=recorded, cache=cache)  # fmt: skip
    plan = dataclasses.replace(plan, notes=plan.notes + _too_short(plan, len(train_enc.samples), run.world.world_size))
    matmul = route_matmuls(run, plan, recorded=recorded, cache=cache)
    torch.manual_seed(plan.train.seed)
    model = _model(plan, request, start.source)
    lora = dict(model.lora_settings) if request.method in ("lora", "qlora") else None
    train_batches = batches(plan.train, run.world.world_size, run.world.rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    finetune_record = {
        "from": start.source.record(), "data": str(Path(request.data).resolve()), "method": request.method,
        "lora": lora, "batching": request.batching, "val_fraction": request.val_fraction,
        "too_long": request.too_long, "trainable": request.trainable, "engine": plan.train.engine, "seq_len": seq_len,
        "max_steps": request.max_steps, "trainable_params": trainable,
        "samples": {"train": len(train_enc.samples), "val": len(val_enc.samples),
                    "truncated": train_enc.truncated + val_enc.truncated,
                    "skipped": train_enc.skipped + val_enc.skipped},
    }  # fmt: skip
    record = _record(plan, finetune_record, start, matmul)
    _say_inputs(run, request, start, lora, trainable, plan, train_enc, val_enc, train_batches)
    start = dataclasses.replace(start, source=None)  # its copy of the weights is no longer needed
    eval_data = chat.eval_batches(val_enc.samples, plan.train.micro_batch, start.pad, rank=run.world.rank,
                                  world_size=run.world.world_size)  # fmt: skip
    # Sharded adapters (fsdp) are gathered on every rank (a collective) before rank 0 writes them.
    out = fit(run, plan, model, train_batches, eval_data, record=record, files=start.files,
              extra_state={"finetune": finetune_record},
              after=(lambda m: lmcore.lora_state(m)) if lora is not None else None)  # fmt: skip
    if lora is not None and run.world.rank == 0:
        lmcore.save_lora(model, run.run_dir / "adapters.safetensors", tensors=out["after"])
    scored = "the response tokens of the held-out samples, as during training"
    nexts = _next_commands(run.run_dir) if request.next_commands else []
    return finish(run, plan, out, as_json=as_json, next_commands=nexts, scored=scored)


def _base(request: FinetuneRequest, start: _Start, saved: RunRecord | None, seq_len: int,
          epoch_batches: Any) -> Base:  # fmt: skip
    """Where a fine-tune's configs start: the source's model (or the resumed run's configs), the fine-tuning
    defaults, one epoch of the training samples unless --max-steps or a budget says otherwise."""
    import lmcore
    from lmtrain.recipes import DataConfig
    from lmtrain.run_plan import saved_base
    from trainloop import TrainConfig

    if saved is not None:
        return saved_base(saved, str(Path(request.out) / "run.json"), None)
    # The loss from the logits of the labelled positions alone (lmcore.labelled_loss): the prompt's positions carry
    # no label, and the (B, T, V) logits are the largest activation of a model with a large vocabulary.
    values: dict[str, Any] = {"model.loss_logits": "labelled"}
    if request.batching == "pack":
        # Attention inside each packed sample: every sample ends with EOS, which closes it (lmcore.documents).
        values["model.document_separator"] = start.eos
    train = TrainConfig(**dict(FINETUNE_DEFAULTS, lr=FULL_LR if request.method == "full" else FINETUNE_DEFAULTS["lr"]))

    def check(model_cfg: Any, train_cfg: Any, data_cfg: Any) -> None:
        if epoch_batches(train_cfg).batches_per_epoch() == 0:
            world = epoch_batches(train_cfg).world_size
            raise LmtrainError(f"{request.data}: {len(epoch_batches(train_cfg).samples)} training sample(s) make "
                               f"fewer than one global batch of {train_cfg.micro_batch * world} rows: add samples or "
                               "lower micro_batch (--set micro_batch=N)")  # fmt: skip

    def size(train_cfg: Any, max_steps: int | None, fixed: set[str]) -> Any:
        from lmtrain.run_plan import size_steps

        check(None, train_cfg, None)  # one global batch at least, before the steps are counted in epochs
        steps = max_steps or (train_cfg.max_steps if "max_steps" in fixed else epoch_batches(train_cfg)
                              .batches_per_epoch())  # fmt: skip
        every = max(1, steps // 4)
        cadence = {"warmup_steps": min(steps // 10, 100), "eval_every": every, "save_every": every,
                   "log_every": min(train_cfg.log_every, steps)}  # fmt: skip
        try:
            train_cfg = dataclasses.replace(train_cfg, **{k: v for k, v in cadence.items() if k not in fixed})
        except ValueError as exc:  # trainloop's ConfigError names the field
            raise LmtrainError(str(exc)) from None
        return size_steps(train_cfg, steps, fixed, "--max-steps" if max_steps else None)

    model = lmcore.ModelConfig.from_dict(dict(start.source.model_config))
    return Base(model, train, DataConfig(seq_len=seq_len), recipe=start.recipe, values=values, check=check,
                size=size, label=start.label)  # fmt: skip


def _lora_parameters(config: Any, request: FinetuneRequest) -> int:
    """The adapters' parameters for ``config`` (lmcore's count); an unknown --lora-targets name is one line."""
    from lmcore.finetune_memory import lora_parameters

    try:
        return lora_parameters(config, request.lora_r, request.lora_targets)
    except ValueError as exc:
        raise LmtrainError(f"--lora-targets {','.join(request.lora_targets)}: {exc}") from None


def _too_short(plan: Any, samples: int, world_size: int) -> tuple[str, ...]:
    """A warning for a fine-tune whose steps are too few to move the weights much (fewer than FEW_STEPS, a rule of
    thumb: a few warmup steps and a handful at the peak rate)."""
    steps = plan.train.max_steps
    if plan.budgeted or steps >= FEW_STEPS:
        return ()
    rows = plan.train.micro_batch * plan.train.grad_accum * world_size
    return (f"warning: {steps} optimizer step(s) of {rows} rows over {samples} training samples (about "
            f"{steps * rows / max(samples, 1):.2g} epoch(s)) at lr {plan.train.lr:g}: too few to learn much; give "
            "--max-steps N (several epochs) or --time-budget SECONDS",)  # fmt: skip


def _model(plan: Any, request: FinetuneRequest, source: Any = None) -> Any:
    """The model that trains: the planned GPT with the source's weights (random ones for a probe), a base model's
    read straight into it (lmtrain.base_model), then the adapters (and the 4-bit base of QLoRA)."""
    import torch

    import lmcore
    from lmtrain.base_model import BaseSource, load_base_weights
    from lmtrain.init_from import load_init_weights

    if isinstance(source, BaseSource):
        # Weights that train are held in fp32 (bf16 compute is autocast's or FSDP's): an AdamW step of lr 5e-5 on a
        # bf16 weight of size 0.02 is below its rounding step and would be lost. A frozen base keeps its checkpoint's
        # precision; LoRA's adapters on it are fp32 (lmcore.lora).
        model = load_base_weights(source, plan.model, torch.float32 if request.method == "full" else None)
    else:
        model = lmcore.GPT(plan.model)
        if source is not None:
            load_init_weights(model, source)
    if request.method in ("lora", "qlora"):
        try:
            lmcore.apply_lora(model, request.lora_targets, request.lora_r, request.lora_alpha, request.lora_dropout)
        except ValueError as exc:
            raise LmtrainError(f"--lora-targets {','.join(request.lora_targets)}: {exc}") from None
        if request.method == "qlora":
            from lmcore.qlora import quantize_frozen_linears

            quantize_frozen_linears(model)
    elif request.trainable is not None:
        _freeze_all_but(model, request.trainable)
    return model


def _freeze_all_but(model: Any, trainable: str) -> None:
    """Only the parameters ``trainable`` names train (TRAINABLE's names, or comma-separated fnmatch patterns on the
    parameter names); one that matches nothing is one LmtrainError listing what there is."""
    import fnmatch

    patterns = TRAINABLE.get(trainable) or tuple(p.strip() for p in trainable.split(",") if p.strip())
    names = [name for name, _ in model.named_parameters()]
    chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if not chosen:
        raise LmtrainError(
            f"--trainable {trainable}: matches no parameter: expected one of {', '.join(TRAINABLE)}, or "
            f"fnmatch patterns on the model's parameter names (such as {names[len(names) // 2]})"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(name in chosen)


def _record(plan: Any, finetune_record: dict[str, Any], start: _Start, cpu_matmul: str | None) -> RunRecord:
    """run.json of a fine-tune; a resumed one keeps what it started with, its world size and training config new."""
    import lmcore

    if plan.saved is not None:
        return dataclasses.replace(plan.saved, world_size=plan.world.world_size, train_config=plan.train.to_dict(),
                                   notes=plan.notes, cpu_matmul=plan.saved.cpu_matmul or cpu_matmul)  # fmt: skip
    return RunRecord(
        command="finetune", data=finetune_record["data"], recipe=plan.recipe,
        schedule="budget" if plan.budgeted else "config", model_config=plan.model.to_dict(),
        train_config=plan.train.to_dict(), data_config=dataclasses.asdict(plan.data), eos_id=start.eos,
        vocab_size=start.vocab_size, bytes_per_token=None, n_params=lmcore.n_params(plan.model),
        tokenizer_sha256=start.tokenizer_sha256, world_size=plan.world.world_size,
        cpu_threads=plan.cpu_threads if plan.cpu_threads is not None else plan.world.threads_now,
        cpu_matmul=cpu_matmul, notes=plan.notes, init_from=start.source.record(), finetune=finetune_record,
        chat_template=start.template.to_json() if start.template is not None else None, base=start.base,
    )  # fmt: skip


def _say_inputs(run: Run, request: FinetuneRequest, start: _Start, lora: Mapping[str, Any] | None, trainable: int,
                plan: Any, train_enc: Any, val_enc: Any, batches: Any) -> None:  # fmt: skip
    import lmcore

    total = lmcore.n_params(plan.model)
    adapters = (f": LoRA r={request.lora_r} alpha={request.lora_alpha:g} dropout={request.lora_dropout:g} on "
                f"{', '.join(lora['targets'])}" if lora else "")  # fmt: skip
    run.say(f"from {start.label}, method {request.method}{adapters}"
            + (", base weights in 4-bit NormalFloat (torchao NF4)" if request.method == "qlora" else ""))  # fmt: skip
    run.say(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)")
    if start.template is None:
        run.say("chat template: the base model's own (its tokenizer files), rendered as transformers renders it")
    else:
        plain = "" if start.template.name == "tokens" else " (no chat tokens in the tokenizer: plain-text markers)"
        run.say(f"chat template: {start.template.name}{plain}")
    run.say(f"{request.data}: {len(train_enc.samples)} training / {len(val_enc.samples)} held-out samples, "
            f"{train_enc.truncated + val_enc.truncated} truncated to {plan.data.seq_len + 1} tokens, "
            f"{train_enc.skipped + val_enc.skipped} skipped ({request.too_long})")  # fmt: skip
    run.say(f"{request.batching}: {batches.batches_per_epoch()} batches of {plan.train.micro_batch} x "
            f"{run.world.world_size} rank(s) per epoch")  # fmt: skip


def _next_commands(run_dir: Path) -> list[str]:
    from lmtrain.shell import export_next, lmtrain_command

    command, run = lmtrain_command(), shlex.quote(str(run_dir))
    return [f"{command} eval --run {run} --prompts HELDOUT.jsonl",
            f"{command} generate --run {run} --chat --prompt TEXT",
            export_next(command, run, "DIR")]  # fmt: skip


def _source_dir(spec: str) -> Path:
    from lmtrain.init_from import parse_init_spec

    run_dir, _ = parse_init_spec(spec, "--from")
    if not run_dir.is_dir():
        raise LmtrainError(
            f"--from {spec}: {run_dir} is not a directory: expected a run written by `lmtrain train`, "
            "or a Hugging Face model directory (config.json, model.safetensors, tokenizer.json)"
        )
    return run_dir


def _request_as_saved(request: FinetuneRequest, saved: Mapping[str, Any]) -> FinetuneRequest:
    """A resumed fine-tune keeps the settings it started with (run.json): method, adapters, batching, split; a new
    --max-steps moves its end."""
    lora = saved.get("lora") or {}
    return dataclasses.replace(
        request,
        method=saved.get("method", request.method),
        batching=saved.get("batching", request.batching),
        val_fraction=saved.get("val_fraction", request.val_fraction),
        seq_len=saved.get("seq_len", request.seq_len),
        too_long=saved.get("too_long", request.too_long),
        trainable=saved.get("trainable", request.trainable),
        # --max-steps on --resume moves the end, as `train --resume --max-steps` does; without it the saved end holds
        max_steps=request.max_steps if request.max_steps is not None else saved.get("max_steps"),
        lora_r=lora.get("r", request.lora_r),
        lora_alpha=lora.get("alpha", request.lora_alpha),
        lora_dropout=lora.get("dropout", request.lora_dropout),
        lora_targets=tuple(lora.get("targets", request.lora_targets)),
    )


def run_finetune(args: argparse.Namespace) -> int:
    """The `lmtrain finetune` command: its flags as a :class:`FinetuneRequest`."""
    from lmtrain.parsers import run_flag_overrides

    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    request = FinetuneRequest(
        source=args.source, data=args.data, out=args.out, method=args.method, lora_r=args.lora_r,
        lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t), batching=args.batching,
        trainable=args.trainable,
        seq_len=args.seq_len, val_fraction=args.val_fraction, too_long=args.too_long, max_steps=args.max_steps,
        time_budget_s=args.time_budget, resume=args.resume, overwrite=args.overwrite, verify=args.verify,
        engine=args.engine, deepspeed=args.deepspeed, gpumon=args.gpumon, compile=args.compile,
        overrides=run_flag_overrides(args), force=args.force,
    )  # fmt: skip
    run_finetune_request(request, as_json=args.json)
    return 0
