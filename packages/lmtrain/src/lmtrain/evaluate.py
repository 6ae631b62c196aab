"""`lmtrain eval`: sliding-window evaluation of a whole text file.

Every token of the text is scored exactly once. The text is encoded losslessly in one piece (decode(encode(text))
== text is checked), with the end-of-document id in front as the first token's context, so the token loss sums
to the information needed for every byte of the file: bits per byte = sum of token losses / ln 2 / UTF-8 bytes.
Windows hold up to `context` tokens and advance by `stride`; each window scores only the tokens after the
previous window's end, so every scored token after the first window sees at least `context - stride` tokens.

Any device and precision (`--device`, `--dtype`), any checkpoint (`--checkpoint`, default the best evaluated one).
Under torchrun (RANK and WORLD_SIZE set) each rank scores every world_size-th batch of windows and the sums are
all-reduced (gloo on CPU, nccl on CUDA): per-token losses are summed in float64, so the figures equal one
process's to rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmtrain.devices import resolve_device, resolve_dtype
from lmtrain.errors import LmtrainError

METRICS = ("loss", "token_ppl", "bits_per_byte", "word_ppl")


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world_size, this rank's device): joins torchrun's process group when WORLD_SIZE > 1 (gloo on CPU,
    nccl on CUDA, where each rank takes cuda:LOCAL_RANK); (0, 1, device) otherwise."""
    import torch.distributed as dist

    from trainloop.distributed import env_world

    rank, local_rank, world = env_world()
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def window_plan(n_targets: int, context: int, stride: int, offset: int = 0) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) input windows over a sequence with `n_targets` + 1 tokens.

    Window inputs are tokens[start:end], its targets tokens[start + 1:end + 1]; targets at positions >=
    first_scored (counted as input positions) are scored. `offset` in [0, stride) shortens the first window,
    shifting the whole grid (the --seeds protocol).

    Example:
        >>> window_plan(10, 4, 2)
        [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    """
    if context < 1 or not 1 <= stride <= context:
        raise LmtrainError(f"need 1 <= stride <= context, got context={context} stride={stride}")
    if not 0 <= offset < stride:
        raise LmtrainError(f"window offset must be in [0, stride={stride}), got {offset}")
    plan = []
    end = min(context - offset, n_targets)
    plan.append((0, end, 0))
    while end < n_targets:
        new_end = min(end + stride, n_targets)
        plan.append((max(0, new_end - context), new_end, end))
        end = new_end
    return plan


def window_batches(n_targets: int, context: int, stride: int, offset: int = 0,
                   batch_size: int = 8) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """The batches of windows that score ``n_targets`` targets: windows of equal length batch together (at most the
    first and the last differ), ``batch_size`` at a time."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for window in window_plan(n_targets, context, stride, offset):
        groups.setdefault(window[1] - window[0], []).append(window)
    return [windows[i : i + batch_size] for windows in groups.values() for i in range(0, len(windows), batch_size)]


@torch.no_grad()
def sliding_window_nll(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    context: int,
    stride: int,
    *,
    offset: int = 0,
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
    progress: Any = None,
) -> tuple[float, int]:
    """(sum of negative log-likelihoods in nats, number of scored tokens) of `tokens[1:]` given what precedes.

    ``progress`` (a :class:`lmtrain.progress.Progress`, optional) hears of every batch this rank scores.

    With `world_size` > 1 (an initialised process group) this rank scores batches rank, rank + world_size, ...
    and the sums are all-reduced, so every rank returns the whole text's figures.

    Example:
        >>> import math, torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny")).eval()
        >>> tokens = torch.randint(0, 97, (20,))
        >>> nll, n = sliding_window_nll(model, tokens, context=32, stride=16)
        >>> whole = model(tokens[None, :-1], labels=tokens[None, 1:]).loss  # 20 tokens fit one window
        >>> n, math.isclose(nll / n, whole.item(), rel_tol=1e-5)
        (19, True)
        >>> sliding_window_nll(model, torch.randint(0, 97, (100,)), context=32, stride=16)[1]
        99
    """
    tokens = tokens.long().flatten()
    n_targets = tokens.numel() - 1
    if n_targets < 1:
        raise LmtrainError("the text encodes to no token to score")
    device = next(model.parameters()).device
    batches = window_batches(n_targets, context, stride, offset, batch_size)
    # Summed in float64 on the device: one host read at the end, and the order of the sums (which batches a rank
    # got) changes the total only at float64 rounding.
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in batches[rank::world_size]:
        inputs = torch.stack([tokens[s:e] for s, e, _ in chunk]).to(device)  # (B, T)
        targets = torch.stack([tokens[s + 1 : e + 1] for s, e, _ in chunk]).to(device)  # (B, T)
        for row, (s, _, first) in enumerate(chunk):
            targets[row, : first - s] = -100  # already scored by the previous window
        logits = model(inputs).logits.float()  # (B, T, V)
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
        total += nll.double().sum()
        count += (targets != -100).sum()
        if progress is not None:
            progress.update()
    sums = torch.stack([total, count]).cpu()
    if world_size > 1:
        from trainloop.distributed import all_reduce_sum

        sums = all_reduce_sum(sums)
    total_nll, scored = float(sums[0]), int(sums[1])
    if scored != n_targets:  # every target exactly once: the plan's invariant
        raise RuntimeError(f"scored {scored} tokens, expected {n_targets}")
    return total_nll, scored


def text_stats(text: str) -> dict[str, int]:
    """Bytes (UTF-8) and words (whitespace-separated, plus one per line end: the word-perplexity convention)."""
    return {"bytes": len(text.encode("utf-8")), "words": len(text.split()) + text.count("\n")}


def encode_for_eval(sp: Any, text: str, eos_id: int | None) -> tuple[torch.Tensor, bool]:
    """Token ids of `text` (with the document start in front, lmtrain.text_codec.document_start: `eos_id` for this
    toolkit's own tokenizers) and whether decoding gives it back."""
    from lmtrain.text_codec import decode, document_start, encode

    ids = encode(sp, text)
    lossless = decode(sp, ids) == text
    start = document_start(sp, eos_id)
    prefix = [] if start is None else [start]
    return torch.tensor(prefix + ids, dtype=torch.long), lossless


def metrics_from_nll(nll: float, tokens: int, stats: dict[str, int]) -> dict[str, float]:
    """Loss per token, perplexities and bits per byte from a total NLL in nats."""
    loss = nll / tokens
    return {
        "loss": loss,
        "token_ppl": math.exp(min(loss, 700.0)),
        "bits_per_byte": nll / math.log(2) / stats["bytes"],
        "word_ppl": math.exp(min(nll / max(1, stats["words"]), 700.0)),
    }


def evaluate_text(
    model: torch.nn.Module,
    sp: Any,
    text: str,
    *,
    context: int,
    stride: int,
    eos_id: int | None,
    repeat: int = 1,
    seeds: list[int] | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Evaluate `text`; with repeats or seeds, also the mean and standard deviation of each metric.

    ``progress`` reports the batches scored (a bar on a terminal, timestamped lines otherwise: lmtrain.progress).

    Each seed shifts the window grid by an offset drawn from [0, stride) (seed 0 without --seeds: no shift) and
    seeds torch; each repeat re-runs the same windows (on CPU the repeats agree exactly; on GPU they measure the
    kernels' run-to-run variation). `rank`/`world_size` split the windows over a process group (see
    `sliding_window_nll`).

    Example (an untrained tiny model and a tokenizer `lmtrain prepare` trained on a little of the standard
    library's source):
        >>> import tempfile
        >>> import sentencepiece as spm
        >>> from lmtrain.examples import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> sp = spm.SentencePieceProcessor(model_file=str(tiny_data(work.name) / "tokenizer.model"))
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny", vocab_size=400)).eval()
        >>> result = evaluate_text(model, sp, "To be, or not to be", context=32, stride=16, eos_id=2)
        >>> result["bytes"], result["words"], result["lossless_encoding"], result["context"], result["stride"]
        (19, 6, True, 32, 16)
        >>> result["tokens"] == len(sp.encode("To be, or not to be"))  # every token scored once
        True
        >>> 5 < result["loss"] < 7  # an untrained model: about ln(400) = 6.0 nats per token
        True
        >>> work.cleanup()
    """
    ids, lossless = encode_for_eval(sp, text, eos_id)
    stats = text_stats(text)
    from lmtrain.progress import Progress

    runs: list[dict[str, Any]] = []
    chosen: list[int | None] = list(seeds) if seeds else [None]
    offsets = [(seed, 0 if seed is None else random.Random(seed).randrange(stride)) for seed in chosen]
    n_targets = max(1, ids.numel() - 1)
    total = repeat * sum(len(window_batches(n_targets, context, stride, off)[rank::world_size]) for _, off in offsets)
    with Progress(f"eval ({stats['bytes']:,} bytes, {n_targets:,} tokens)", total, unit="batches",
                  enabled=progress) as bar:  # fmt: skip
        for seed, offset in offsets:
            for r in range(repeat):
                torch.manual_seed(0 if seed is None else seed)
                nll, n = sliding_window_nll(model, ids, context, stride, offset=offset, rank=rank,
                                            world_size=world_size, progress=bar)  # fmt: skip
                runs.append({"seed": seed, "repeat": r, "offset": offset, **metrics_from_nll(nll, n, stats)})
    result: dict[str, Any] = {
        "tokens": n_targets,
        **stats,
        "context": context,
        "stride": stride,
        "lossless_encoding": lossless,
        **{k: runs[0][k] for k in METRICS},
    }
    if len(runs) > 1:
        for key in METRICS:
            values = [run[key] for run in runs]
            result[key] = statistics.fmean(values)
            result[f"{key}_std"] = statistics.stdev(values)
        result["runs"] = runs
    return result


def check_finite(result: dict[str, Any], model: torch.nn.Module, checkpoint: Path, dtype: str) -> None:
    """Refuse, in one line, an evaluation whose figures are not finite numbers: the checkpoint, why (weights that
    hold NaN or inf, or an overflow in a 16-bit `dtype`) and what to evaluate instead."""
    from trainloop.checkpoint import CheckpointStore

    figures = {k: v for k, v in result.items() if k in METRICS or k.endswith("_std")}
    bad = {k: v for k, v in figures.items() if not math.isfinite(v)}
    if not bad:
        return
    shown = " ".join(map(str, next(iter(bad.items()))))  # e.g. "loss nan"
    earlier: list[int] = []
    if checkpoint.parent.name == "checkpoints" and (step := re.fullmatch(r"step_(\d+)", checkpoint.name)):
        earlier = [s for s in CheckpointStore(checkpoint.parent.parent).steps() if s < int(step.group(1))]
    which = f" (earlier ones here: steps {', '.join(map(str, earlier[-5:]))})" if earlier else ""
    earlier_fix = f"evaluate an earlier checkpoint with --checkpoint STEP{which}"
    if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        cause = f"its weights are finite, the activations overflowed in --dtype {dtype}"
        fix = "evaluate with --dtype fp32" if dtype != "fp32" else earlier_fix
    else:
        cause, fix = "its weights hold NaN or inf values (a diverged run, or damaged weights)", earlier_fix
    raise LmtrainError(f"{checkpoint}: the evaluation gave {shown}: {cause}; {fix}")


def _run_prompts(args: argparse.Namespace) -> int:
    from lmtrain.generation_eval import run_prompts

    return run_prompts(args)


def run_eval(args: argparse.Namespace) -> int:
    """The `lmtrain eval` command (one process, or every rank of a torchrun job; rank 0 prints)."""
    import torch.distributed as dist

    from lmtrain.harness import check_mode_flags
    from lmtrain.run_files import load_tokenizer, load_trained_model

    if args.prompts is not None:
        return _run_prompts(args)
    check_mode_flags(args)
    if args.repeat < 1:
        raise LmtrainError(f"--repeat must be >= 1, got {args.repeat}")
    for flag, value in (("--context", args.context), ("--stride", args.stride)):
        if value is not None and value < 1:
            raise LmtrainError(f"{flag} must be >= 1 (tokens), got {value}")
    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmtrainError(f"--text {path}: cannot read UTF-8 text: {exc}") from None
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    rank, world_size, device = init_distributed(device)
    try:
        model, run, checkpoint = load_trained_model(
            args.run,
            str(device),
            checkpoint=args.checkpoint,
            verify=args.verify,
            dtype=dtype,
            on_note=(lambda note: print(f"lmtrain eval: {note}", file=sys.stderr)) if rank == 0 else None,
        )
        if args.compile:
            import lmcore

            lmcore.compile_model(model)
        sp = load_tokenizer(args.run)
        context = args.context if args.context is not None else run.seq_len
        stride = args.stride if args.stride is not None else max(1, context // 2)
        result = evaluate_text(
            model, sp, text, context=context, stride=stride, eos_id=run.eos_id, repeat=args.repeat,
            seeds=args.seeds, rank=rank, world_size=world_size, progress=rank == 0,
        )  # fmt: skip
    finally:
        if world_size > 1 and dist.is_initialized():
            from trainloop.distributed import wait_for_idle_gloo_workers

            dist.destroy_process_group()
            wait_for_idle_gloo_workers()  # nothing left for a gloo worker to free while the interpreter finalises
    check_finite(result, model, checkpoint, args.dtype)  # every rank: they all hold the all-reduced figures
    if rank != 0:
        return 0
    result.update(checkpoint=str(checkpoint), text=str(path), device=str(device), dtype=args.dtype, ranks=world_size)
    if not result["lossless_encoding"]:
        print(f"warning: the tokenizer does not round-trip {path}; bits per byte is not exact", file=sys.stderr)
    if args.json:
        print(json.dumps(result, allow_nan=False))  # NaN and Infinity are not JSON; check_finite refused them
    else:
        spread = (
            "" if "loss_std" not in result else f" (+- {result['bits_per_byte_std']:.4f} over {len(result['runs'])})"
        )
        print(
            f"{path}: {result['tokens']:,} tokens, {result['bytes']:,} bytes, {result['words']:,} words\n"
            f"loss {result['loss']:.4f} nats/token, token ppl {_figure(result['token_ppl'])}, "
            f"bits/byte {result['bits_per_byte']:.4f}{spread}, word ppl {_figure(result['word_ppl'])}\n"
            f"checkpoint {checkpoint}, context {context}, stride {stride}, {device} {args.dtype}, {world_size} rank(s)"
            + (f", {torch.get_num_threads()} CPU thread(s)" if device.type == "cpu" else "")
        )
    return 0


def _figure(value: float) -> str:
    """A perplexity to 4 significant digits: ``207.8``, ``2.514e+07`` (not ``25135697.54``)."""
    return f"{value:.4g}"
