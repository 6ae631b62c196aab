"""`lmtrain eval --prompts`: what a model generates, scored against references.

Each line of the prompts file is a chat sample (``messages`` whose last turn is the assistant's reference answer, or
``prompt`` with ``reference``/``response``) or a plain prompt (``{"prompt", "reference"}`` for a run without a chat
template). The model continues each prompt (greedy, or sampled with a seed) until its end-of-turn piece, EOS or
``max_new_tokens``; the figures are corpus BLEU-4 (sacrebleu, its default 13a tokenization), the mean ROUGE-L F1
(rouge-score) and the share of exact matches (after stripping surrounding whitespace), each with its count. Every
prompt, reference and generation goes to a JSONL file, in the order of the prompts file and without the model's
name, for blind rating. sacrebleu and rouge-score are the ``eval`` extra.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError


def require_scorers() -> tuple[Any, Any]:
    """(sacrebleu, rouge_score.rouge_scorer), or one LmtrainError naming the extra."""
    try:
        import sacrebleu
        from rouge_score import rouge_scorer
    except ImportError as exc:
        from lmcore.extras import install_hint

        raise LmtrainError(f"--prompts needs sacrebleu and rouge-score, which are not importable here ({exc.name}): "
                           f"{install_hint('eval', 'lmtrain')}") from None  # fmt: skip
    return sacrebleu, rouge_scorer


def read_prompts(path: str | os.PathLike) -> list[tuple[tuple[tuple[str, str], ...] | str, str]]:
    """(prompt, reference) per line: the prompt as chat turns (ending before the reference's assistant turn) or as
    plain text (a ``prompt`` field with a ``reference``). A line without a reference is one LmtrainError."""
    from lmtrain.chat import _open_text, parse_sample

    path = Path(path)
    if not path.is_file():
        raise LmtrainError(f"--prompts {path}: no such file: expected JSONL prompts with references")
    out: list[tuple[tuple[tuple[str, str], ...] | str, str]] = []
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LmtrainError(f"{where}: expected a JSON object, found text that is not JSON ({exc.msg}); fix "
                                   "or remove the line") from None  # fmt: skip
            if isinstance(obj, dict) and "prompt" in obj and "reference" in obj:
                if not isinstance(obj["prompt"], str) or not isinstance(obj["reference"], str):
                    raise LmtrainError(f"{where}: prompt and reference: expected strings; fix the line")
                out.append((obj["prompt"], obj["reference"]))
                continue
            if isinstance(obj, dict) and "prompt" in obj and "response" not in obj:
                raise LmtrainError(f"{where}: expected a reference answer ('reference', 'response', or a final "
                                   f"assistant turn), found keys {sorted(obj)[:6]}; add the reference")  # fmt: skip
            if isinstance(obj, dict) and "messages" in obj:
                messages = obj["messages"]
                if isinstance(messages, list) and (not messages or not isinstance(messages[-1], dict)
                                                   or messages[-1].get("role") != "assistant"):  # fmt: skip
                    raise LmtrainError(f"{where}: expected the last message to be the assistant's reference answer, "
                                       "found none; add the reference as a final assistant turn")  # fmt: skip
            turns, _ = parse_sample(line, where)
            out.append((turns[:-1], turns[-1][1]))
    if not out:
        raise LmtrainError(f"--prompts {path}: no prompts: expected one JSON object per line")
    return out


def score(generations: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """BLEU-4, ROUGE-L F1 and exact match of ``generations`` against ``references``, with the count. ROUGE-L uses
    rouge-score's own tokenizer, which keeps lowercased letters and digits only (``x = 1`` is ``x 1``).

    Example:
        >>> result = score(["return a + b", "x = 1"], ["return a + b", "x = 2"])
        >>> result["exact_match"], result["count"], result["rougeL_f1"]  # ROUGE-L: (1 + 1/2) / 2
        (0.5, 2, 0.75)
    """
    sacrebleu, rouge_scorer = require_scorers()
    bleu = sacrebleu.corpus_bleu(list(generations), [list(references)])
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rouge = [scorer.score(r, g)["rougeL"].fmeasure for g, r in zip(generations, references, strict=True)]
    exact = [g.strip() == r.strip() for g, r in zip(generations, references, strict=True)]
    n = len(references)
    return {"bleu4": bleu.score, "bleu_signature": str(bleu.format(signature=True)).split(" = ")[0],
            "rougeL_f1": sum(rouge) / n, "exact_match": sum(exact) / n, "count": n}  # fmt: skip


def generate_answers(model: Any, sp: Any, run: dict, prompts: Sequence[Any], *, max_new_tokens: int,
                     temperature: float, seed: int | None, top_k: int | None) -> list[str]:  # fmt: skip
    """The model's answer to each prompt (chat prompts through the run's template, plain ones as text)."""
    import torch

    from lmcore import generate
    from lmtrain.chat import ChatTemplate, template_for
    from lmtrain.text_codec import decode, encode

    template = (ChatTemplate.from_json(run.chat_template, "run.json") if run.chat_template
                else template_for(sp))  # fmt: skip
    eos = run.eos_id
    stop = sp.piece_to_id(template.end) if template.name == "tokens" else eos
    device = next(model.parameters()).device
    answers = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = encode(sp, prompt)
            if eos is not None and eos >= 0 and model.config.document_separator is None:
                ids = [eos, *ids]
        else:
            ids = encode(sp, template.render(prompt, add_generation_prompt=True))
        out = generate(model, torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                       top_k=top_k, eos_id=stop, seed=None if seed is None else seed + i)  # fmt: skip
        new = [int(t) for t in out[0, len(ids) :].tolist()]
        for end in (stop, eos):
            if end is not None and end in new:
                new = new[: new.index(end)]
        text = decode(sp, new)
        if template.name == "plain" and not isinstance(prompt, str):
            text = text.split(template.end)[0]  # the plain template's end of turn is text
        answers.append(text)
    return answers


def evaluate_prompts(run_dir: str | os.PathLike, prompts_file: str | os.PathLike, out: str | os.PathLike | None = None,
                     *, checkpoint: str = "best", max_new_tokens: int = 256, temperature: float = 0.0,
                     seed: int | None = None, top_k: int | None = None, device: str | None = None,
                     limit: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Generate an answer to every prompt of ``prompts_file`` with the run's ``checkpoint`` and score them (module
    docstring); the prompts, references and generations go to ``out`` (default
    ``RUN_DIR/generations-<checkpoint>.jsonl``). Returns the scores with the checkpoint and the output file."""
    from lmtrain.evaluate import resolve_device
    from lmtrain.run_files import load_tokenizer, load_trained_model

    require_scorers()
    if max_new_tokens < 1:
        raise LmtrainError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    items = read_prompts(prompts_file)[:limit]
    where = resolve_device(device)
    model, run, path = load_trained_model(run_dir, str(where), checkpoint=checkpoint)
    sp = load_tokenizer(run_dir)
    answers = generate_answers(model, sp, run, [p for p, _ in items], max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, top_k=top_k)  # fmt: skip
    references = [r for _, r in items]
    result = score(answers, references)
    target = Path(out) if out is not None else Path(run_dir) / f"generations-{path.name}.jsonl"
    from trainloop.checkpoint import open_new

    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    with open_new(tmp) as f:
        for i, ((prompt, reference), answer) in enumerate(zip(items, answers, strict=True)):
            shown = prompt if isinstance(prompt, str) else [{"role": r, "content": c} for r, c in prompt]
            f.write(json.dumps({"id": i, "prompt": shown, "reference": reference, "generation": answer}) + "\n")
    os.replace(tmp, target)
    return result | {"checkpoint": str(path), "generations": str(target), "temperature": temperature, "seed": seed}
