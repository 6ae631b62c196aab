"""The fine-tuning workflow on this machine's standard library, no download: `lmtrain demo --finetune`.

After pretraining, instruction pairs are built from the same source (a function's signature and docstring as the
prompt, its body as the answer; lmtrain.instructions), held out by module, and the run is fine-tuned with LoRA.
Before and after: the mean loss over the held-out answers' tokens, and BLEU-4 / ROUGE-L of greedy answers to
held-out prompts (the eval extra; without it the loss alone is shown).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

DEMO_PAIRS = 1500
DEMO_PAIR_CHARS = 600  # prompt + answer, about 250 tokens of the demo's vocabulary: a 256-token row holds one
DEMO_SEQ_LEN = 256
DEMO_PROMPTS = 24  # held-out prompts answered before and after (greedy)
DEMO_NEW_TOKENS = 96
DEMO_LORA_R, DEMO_LORA_ALPHA, DEMO_LORA_DROPOUT = 16, 32.0, 0.05
DEMO_LR = 2e-3  # a small model and a short budget: a larger step than FINETUNE_DEFAULTS' 2e-4


def heldout_response_loss(run_dir: str | Path, data: str | Path, *, checkpoint: str = "best", seq_len: int,
                          val_fraction: float = 0.1, micro_batch: int = 8) -> dict[str, float]:  # fmt: skip
    """The mean loss over the response tokens of ``data``'s held-out samples (as `finetune` splits and encodes
    them) for a checkpoint of ``run_dir``: the figure `finetune` evaluates, for any run."""
    from lmtrain import chat
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from trainloop.evaluation import evaluate

    model, _, _ = load_trained_model(run_dir, checkpoint=checkpoint)
    sp = load_tokenizer(run_dir)
    _, val = chat.split_samples(chat.read_samples(data), val_fraction)
    encoded = chat.encode_samples(sp, chat.template_for(sp), val, seq_len)
    batches = chat.eval_batches(encoded.samples, micro_batch, chat.pad_id_for(sp))
    result = evaluate(lambda x, y: model(x, y).loss, model, batches)
    if result is None:
        raise LmtrainError(f"{data}: no held-out samples to evaluate")
    return result


def heldout_prompts(data: str | Path, out: Path, n: int, val_fraction: float = 0.1) -> Path:
    """The first ``n`` held-out samples of ``data`` as an `eval --prompts` file (the answer as the reference)."""
    from lmtrain import chat

    _, val = chat.split_samples(chat.read_samples(data), val_fraction)
    with open(out, "w", encoding="utf-8") as f:
        for s in val[:n]:
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in s.turns]}) + "\n")
    return out


def demo_finetune(run_dir: Path, out: Path, time_budget_s: float, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``run_dir`` with LoRA on instruction pairs from the standard library for ``time_budget_s`` seconds
    into ``out / "finetune"``, and report the held-out response loss and generation scores before and after."""
    from lmtrain.finetune_run import FinetuneRequest, run_finetune_request
    from lmtrain.instructions import write_instructions

    pairs = out / "instructions.jsonl"
    info = write_instructions(pairs, DEMO_PAIRS, DEMO_PAIR_CHARS)
    say(f"[finetune 1/2] instructions: {info['pairs']} (signature + docstring -> body) pairs from {info['modules']} "
        f"standard-library modules -> {pairs}; held out by module")  # fmt: skip
    before = heldout_response_loss(run_dir, pairs, seq_len=DEMO_SEQ_LEN)
    prompts = heldout_prompts(pairs, out / "heldout_prompts.jsonl", DEMO_PROMPTS)
    scores_before = _scores(run_dir, prompts, out / "generations-before.jsonl")
    ft = out / "finetune"
    say(f"[finetune 2/2] LoRA r={DEMO_LORA_R} on q, k, v, o for {time_budget_s:.0f} s")
    settings = {"lr": DEMO_LR, "eval_every": 0, "save_every": 0, "micro_batch": 8, "warmup_steps": 20, "log_every": 20}
    request = FinetuneRequest(
        f"{run_dir}:best",
        str(pairs),
        str(ft),
        seq_len=DEMO_SEQ_LEN,
        batching="pack",
        time_budget_s=time_budget_s,
        overwrite=True,
        overrides=settings,
        lora_r=DEMO_LORA_R,
        lora_alpha=DEMO_LORA_ALPHA,
        lora_dropout=DEMO_LORA_DROPOUT,
        next_commands=False,
    )  # the demo's own list of next commands ends it
    summary = run_finetune_request(request)
    after = heldout_response_loss(ft, pairs, seq_len=DEMO_SEQ_LEN, checkpoint="latest")
    scores_after = _scores(ft, prompts, out / "generations-after.jsonl", checkpoint="latest")
    result = {"loss_before": before["loss"], "loss_after": after["loss"], "loss_se": after.get("loss_se"),
              "tokens": after["tokens"], "steps": summary.step, "before": scores_before,
              "after": scores_after}  # fmt: skip
    se = after.get("loss_se", float("nan"))
    say(f"held-out response loss: {before['loss']:.3f} before -> {after['loss']:.3f} after {summary.step} steps "
        f"({int(after['tokens']):,} answer tokens, standard error {se:.3f})")  # fmt: skip
    if scores_before and scores_after:
        n = scores_after["count"]
        say(f"BLEU-4 on {n} held-out prompts (greedy): {scores_before['bleu4']:.2f} before -> "
            f"{scores_after['bleu4']:.2f} after; ROUGE-L F1 {scores_before['rougeL_f1']:.3f} -> "
            f"{scores_after['rougeL_f1']:.3f}; generations in {out}/generations-*.jsonl")  # fmt: skip
    else:
        from lmcore.extras import install_hint

        say(f"BLEU-4 / ROUGE-L: not computed (the eval extra is not installed: {install_hint('eval', 'lmtrain')})")
    return result


def _scores(run_dir: Path, prompts: Path, out: Path, checkpoint: str = "best") -> dict[str, Any] | None:
    from lmtrain.generation_eval import evaluate_prompts

    try:
        return evaluate_prompts(run_dir, prompts, out, checkpoint=checkpoint, max_new_tokens=DEMO_NEW_TOKENS)
    except LmtrainError as exc:
        if "needs sacrebleu" in str(exc):
            return None
        raise
