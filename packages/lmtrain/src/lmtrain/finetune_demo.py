"""The fine-tuning workflow on this machine's standard library, no download: `lmtrain demo --finetune`.

After pretraining, instruction pairs are built from the same source (a function's signature and docstring as the
prompt, its body as the answer; lmtrain.instructions), held out by module, and the run is fine-tuned with LoRA.
With `--base DIR` the pretraining is skipped and a Hugging Face base model (lmtrain.base_model) is fine-tuned
instead, through its own tokenizer and chat template. Before and after: the mean loss over the held-out answers'
tokens, and BLEU-4 / ROUGE-L of greedy answers to held-out prompts (the eval extra; without it the loss alone is
shown).
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
# A base model (--base): a model of 100M parameters and more takes seconds per step on a CPU: fewer, smaller steps,
# each logged.
DEMO_BASE_SETTINGS: dict[str, Any] = {"lr": 1e-3, "micro_batch": 4, "warmup_steps": 2, "log_every": 1}


def heldout_response_loss(source: str | Path, data: str | Path, *, checkpoint: str = "best", seq_len: int,
                          val_fraction: float = 0.1, micro_batch: int = 8) -> dict[str, float]:  # fmt: skip
    """The mean loss over the response tokens of ``data``'s held-out samples (as `finetune` splits and encodes
    them) for a checkpoint of the run ``source``, or for the Hugging Face base model directory ``source`` itself:
    the figure `finetune` evaluates, for any run and any base."""
    from lmtrain import chat
    from trainloop.evaluation import evaluate

    model, tokenizer, _ = _model_of(source, checkpoint)
    _, val = chat.split_samples(chat.read_samples(data), val_fraction)
    encode, pad = _chat_encoding(tokenizer, str(source))
    encoded = chat.encode_samples_with(encode, val, seq_len)
    batches = chat.eval_batches(encoded.samples, micro_batch, pad)
    result = evaluate(lambda x, y: model(x, y).loss, model, batches)
    if result is None:
        raise LmtrainError(f"{data}: no held-out samples to evaluate")
    return result


def _model_of(source: str | Path, checkpoint: str) -> tuple[Any, Any, Any]:
    """(model in eval mode, tokenizer, RunRecord or None) of a run's checkpoint or of a base model directory."""
    from lmtrain.base_model import is_base_dir, load_base_model
    from lmtrain.run_files import load_tokenizer, load_trained_model

    if is_base_dir(source):
        model, base = load_base_model(str(source))
        return model, base.tokenizer, None
    model, run, _ = load_trained_model(source, checkpoint=checkpoint)
    return model, load_tokenizer(source), run


def _chat_encoding(tokenizer: Any, where: str) -> tuple[Callable[..., tuple[list[int], list[int]]], int]:
    """(turns -> (ids, labels), the padding id) as `finetune` encodes samples for this tokenizer: a base model's
    own chat template, or this toolkit's template of a run's SentencePiece model."""
    from lmtrain import base_model, chat
    from lmtrain.text_codec import is_base_tokenizer

    if is_base_tokenizer(tokenizer):
        return base_model.chat_encoder(tokenizer, where), base_model.pad_id(tokenizer)
    template = chat.template_for(tokenizer)
    return (lambda turns: chat.encode_turns(tokenizer, template, turns)), chat.pad_id_for(tokenizer)


def heldout_prompts(data: str | Path, out: Path, n: int, val_fraction: float = 0.1) -> Path:
    """The first ``n`` held-out samples of ``data`` as an `eval --prompts` file (the answer as the reference)."""
    from lmtrain import chat

    _, val = chat.split_samples(chat.read_samples(data), val_fraction)
    with open(out, "w", encoding="utf-8") as f:
        for s in val[:n]:
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in s.turns]}) + "\n")
    return out


def demo_finetune(source: Path, out: Path, time_budget_s: float, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``source`` with LoRA on instruction pairs from the standard library for ``time_budget_s`` seconds
    into ``out / "finetune"``, and report the held-out response loss and generation scores before and after.
    ``source`` is a run directory (its best checkpoint) or a Hugging Face base model directory (its weights)."""
    from lmtrain.base_model import is_base_dir
    from lmtrain.finetune_run import FinetuneRequest, run_finetune_request
    from lmtrain.instructions import write_instructions

    base = is_base_dir(source)
    pairs = out / "instructions.jsonl"
    info = write_instructions(pairs, DEMO_PAIRS, DEMO_PAIR_CHARS)
    say(f"[finetune 1/2] instructions: {info['pairs']} (signature + docstring -> body) pairs from {info['modules']} "
        f"standard-library modules -> {pairs}; held out by module")  # fmt: skip
    before = heldout_response_loss(source, pairs, seq_len=DEMO_SEQ_LEN)
    prompts = heldout_prompts(pairs, out / "heldout_prompts.jsonl", DEMO_PROMPTS)
    scores_before = _scores(source, prompts, out / "generations-before.jsonl")
    ft = out / "finetune"
    say(f"[finetune 2/2] LoRA r={DEMO_LORA_R} on q, k, v, o for {time_budget_s:.0f} s"
        + (f", from the base model {source} (its tokenizer and chat template)" if base else ""))  # fmt: skip
    settings = {"lr": DEMO_LR, "eval_every": 0, "save_every": 0, "micro_batch": 8, "warmup_steps": 20, "log_every": 20}
    if base:  # a model of 100M parameters and more takes seconds per step on a CPU: fewer, smaller steps
        settings.update(DEMO_BASE_SETTINGS)
    request = FinetuneRequest(
        str(source) if base else f"{source}:best",
        str(pairs),
        str(ft),
        seq_len=DEMO_SEQ_LEN,
        batching="pad" if base else "pack",  # a base's template does not end every sample with EOS: pad
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


def _scores(source: Path, prompts: Path, out: Path, checkpoint: str = "best") -> dict[str, Any] | None:
    """Generation scores of a run's checkpoint or of a base model directory on ``prompts``; None without the eval
    extra."""
    from lmtrain.base_model import is_base_dir
    from lmtrain.generation_eval import evaluate_prompts, read_prompts, require_scorers, score_prompts

    try:
        if not is_base_dir(source):
            return evaluate_prompts(source, prompts, out, checkpoint=checkpoint, max_new_tokens=DEMO_NEW_TOKENS)
        require_scorers()
        model, tokenizer, _ = _model_of(source, checkpoint)
        return score_prompts(model, tokenizer, None, read_prompts(prompts), out, max_new_tokens=DEMO_NEW_TOKENS,
                             where=str(prompts))  # fmt: skip
    except LmtrainError as exc:
        if "needs sacrebleu" in str(exc):
            return None
        raise
