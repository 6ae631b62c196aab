"""`lmtrain eval`: sliding-window evaluation of a whole text file.

Every token of the text is scored exactly once. The text is encoded losslessly in one piece (decode(encode(text))
== text is checked), with the end-of-document id in front as the first token's context, so the token loss sums
to the information needed for every byte of the file: bits per byte = sum of token losses / ln 2 / UTF-8 bytes.
Windows hold up to `context` tokens and advance by `stride`; each window scores only the tokens after the
previous window's end, so every scored token after the first window sees at least `context - stride` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmtrain.errors import LmtrainError

METRICS = ("loss", "token_ppl", "bits_per_byte", "word_ppl")


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


@torch.no_grad()
def sliding_window_nll(
    model: torch.nn.Module, tokens: torch.Tensor, context: int, stride: int, *, offset: int = 0, batch_size: int = 8
) -> tuple[float, int]:
    """(sum of negative log-likelihoods in nats, number of scored tokens) of `tokens[1:]` given what precedes.

    Example:
        >>> nll, n = sliding_window_nll(model, torch.tensor([0, 5, 9, 2]), context=256, stride=128)  # doctest: +SKIP
    """
    tokens = tokens.long().flatten()
    n_targets = tokens.numel() - 1
    if n_targets < 1:
        raise LmtrainError("the text encodes to no token to score")
    device = next(model.parameters()).device
    plan = window_plan(n_targets, context, stride, offset)
    total, count = 0.0, 0
    # Windows of equal length batch together; at most the first and the last differ.
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for window in plan:
        groups.setdefault(window[1] - window[0], []).append(window)
    for windows in groups.values():
        for i in range(0, len(windows), batch_size):
            chunk = windows[i : i + batch_size]
            inputs = torch.stack([tokens[s:e] for s, e, _ in chunk]).to(device)  # (B, T)
            targets = torch.stack([tokens[s + 1 : e + 1] for s, e, _ in chunk]).to(device)  # (B, T)
            for row, (s, _, first) in enumerate(chunk):
                targets[row, : first - s] = -100  # already scored by the previous window
            logits = model(inputs).logits.float()  # (B, T, V)
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
            total += float(nll)
            count += int((targets != -100).sum())
    if count != n_targets:  # every target exactly once: the plan's invariant
        raise RuntimeError(f"scored {count} tokens, expected {n_targets}")
    return total, count


def text_stats(text: str) -> dict[str, int]:
    """Bytes (UTF-8) and words (whitespace-separated, plus one per line end: the word-perplexity convention)."""
    return {"bytes": len(text.encode("utf-8")), "words": len(text.split()) + text.count("\n")}


def encode_for_eval(sp: Any, text: str, eos_id: int | None) -> tuple[torch.Tensor, bool]:
    """Token ids of `text` (with `eos_id` in front when the tokenizer has one) and whether decoding gives it back."""
    from lmtrain.text_codec import decode, encode

    ids = encode(sp, text)
    lossless = decode(sp, ids) == text
    prefix = [eos_id] if eos_id is not None and eos_id >= 0 else []
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
) -> dict[str, Any]:
    """Evaluate `text`; with repeats or seeds, also the mean and standard deviation of each metric.

    Each seed shifts the window grid by an offset drawn from [0, stride) (seed 0 without --seeds: no shift) and
    seeds torch; each repeat re-runs the same windows (on CPU the repeats agree exactly; on GPU they measure the
    kernels' run-to-run variation).

    Example:
        >>> evaluate_text(model, sp, "To be, or not to be", context=64, stride=32, eos_id=2)["tokens"]  # doctest: +SKIP
    """
    ids, lossless = encode_for_eval(sp, text, eos_id)
    stats = text_stats(text)
    runs = []
    for seed in seeds if seeds else [None]:
        offset = 0 if seed is None else random.Random(seed).randrange(stride)
        for r in range(repeat):
            torch.manual_seed(0 if seed is None else seed)
            nll, n = sliding_window_nll(model, ids, context, stride, offset=offset)
            runs.append({"seed": seed, "repeat": r, "offset": offset, **metrics_from_nll(nll, n, stats)})
    result: dict[str, Any] = {
        "tokens": len(ids) - (1 if len(ids) and eos_id is not None and eos_id >= 0 else 0),
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


def run_eval(args: argparse.Namespace) -> int:
    """The `lmtrain eval` command."""
    from lmtrain.run_files import load_tokenizer, load_trained_model

    if args.repeat < 1:
        raise LmtrainError(f"--repeat must be >= 1, got {args.repeat}")
    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmtrainError(f"--text {path}: cannot read UTF-8 text: {exc}") from None
    model, run, checkpoint = load_trained_model(args.run)
    sp = load_tokenizer(args.run)
    context = args.context or run["data_config"]["seq_len"]
    stride = args.stride or max(1, context // 2)
    result = evaluate_text(
        model, sp, text, context=context, stride=stride, eos_id=run.get("eos_id"), repeat=args.repeat, seeds=args.seeds
    )
    result["checkpoint"] = str(checkpoint)
    result["text"] = str(path)
    if not result["lossless_encoding"]:
        print(f"warning: the tokenizer does not round-trip {path}; bits per byte is not exact", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        spread = (
            "" if "loss_std" not in result else f" (+- {result['bits_per_byte_std']:.4f} over {len(result['runs'])})"
        )
        print(
            f"{path}: {result['tokens']:,} tokens, {result['bytes']:,} bytes, {result['words']:,} words\n"
            f"loss {result['loss']:.4f} nats/token, token ppl {result['token_ppl']:.2f}, "
            f"bits/byte {result['bits_per_byte']:.4f}{spread}, word ppl {result['word_ppl']:.2f}\n"
            f"checkpoint {checkpoint}, context {context}, stride {stride}"
        )
    return 0
