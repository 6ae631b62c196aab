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

import argparse
import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmtrain.errors import WRITE_ERRNOS, LmtrainError, refuse_output_over_input, write_failure_message


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
    """(prompt, reference) per line: the prompt as chat turns (ending before the reference's assistant turn, or all
    of them when a ``reference`` field holds the answer, the layout of most held-out sets) or as plain text (a
    ``prompt`` field with a ``reference``). A line without a reference, text that is not UTF-8 JSON, and JSON nested
    too deeply are one LmtrainError naming the file and line."""
    from lmtrain.chat import open_text, parse_sample
    from lmtrain.text_codec import load_json_line

    path = Path(path)
    if not path.is_file():
        raise LmtrainError(f"--prompts {path}: no such file: expected JSONL prompts with references")
    out: list[tuple[tuple[tuple[str, str], ...] | str, str]] = []
    number = 0
    try:
        with open_text(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    out.append(_prompt_of(line, f"{path} line {number}", load_json_line, parse_sample))
    except (UnicodeDecodeError, EOFError, zlib.error) as exc:
        raise LmtrainError(f"--prompts {path}: unreadable after line {number} ({type(exc).__name__}: {exc}): expected "
                           "UTF-8 JSONL, plain or gzip") from None  # fmt: skip
    if not out:
        raise LmtrainError(f"--prompts {path}: no prompts: expected one JSON object per line")
    return out


def _prompt_of(line: str, where: str, load: Any, parse_sample: Any) -> tuple[tuple[tuple[str, str], ...] | str, str]:
    obj = load(line, where)
    if isinstance(obj, dict) and "reference" in obj and ("prompt" in obj or "messages" in obj):
        if not isinstance(obj["reference"], str):
            raise LmtrainError(f"{where}: reference: expected a string, found {type(obj['reference']).__name__}; "
                               "fix the line")  # fmt: skip
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise LmtrainError(f"{where}: prompt and reference: expected strings; fix the line")
            return obj["prompt"], obj["reference"]
        messages = obj["messages"]
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and \
                messages[-1].get("role") == "assistant":  # fmt: skip
            raise LmtrainError(f"{where}: both a final assistant turn and a 'reference': expected one reference "
                               "answer; drop one of them")  # fmt: skip
        if not obj["reference"].strip():
            raise LmtrainError(f"{where}: reference: expected the answer text, found an empty string; fix the line")
        # The chat turns are checked as a fine-tuning sample's are, with the reference as the answer to come.
        answer = {"role": "assistant", "content": obj["reference"]}
        turns, _ = parse_sample(json.dumps({"messages": [*messages, answer]}), where)
        return turns[:-1], obj["reference"]
    if isinstance(obj, dict) and "prompt" in obj and "response" not in obj:
        raise LmtrainError(f"{where}: expected a reference answer ('reference', 'response', or a final assistant "
                           f"turn), found keys {sorted(obj)[:6]}; add the reference")  # fmt: skip
    if isinstance(obj, dict) and "messages" in obj:
        messages = obj["messages"]
        if isinstance(messages, list) and (not messages or not isinstance(messages[-1], dict)
                                           or messages[-1].get("role") != "assistant"):  # fmt: skip
            raise LmtrainError(f"{where}: expected the last message to be the assistant's reference answer, or a "
                               "'reference' field, found neither; add the reference")  # fmt: skip
    turns, _ = parse_sample(json.dumps(obj), where)
    return turns[:-1], turns[-1][1]


def score(generations: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """BLEU-4, ROUGE-L F1 and exact match of ``generations`` against ``references``, with the count. ROUGE-L uses
    rouge-score's own tokenizer, which keeps lowercased letters and digits only (``x = 1`` is ``x 1``).

    Example:
        >>> result = score(["return a + b", "x = 1"], ["return a + b", "x = 2"])
        >>> result["exact_match"], result["count"], result["rougeL_f1"]  # ROUGE-L: (1 + 1/2) / 2
        (0.5, 2, 0.75)
        >>> result["bleu_signature"]  # sacrebleu's own, for reporting beside the score  # doctest: +ELLIPSIS
        'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...'
    """
    sacrebleu, rouge_scorer = require_scorers()
    metric = sacrebleu.metrics.BLEU()
    bleu = metric.corpus_score(list(generations), [list(references)])
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rouge = [scorer.score(r, g)["rougeL"].fmeasure for g, r in zip(generations, references, strict=True)]
    exact = [g.strip() == r.strip() for g, r in zip(generations, references, strict=True)]
    n = len(references)
    return {"bleu4": bleu.score, "bleu_signature": str(metric.get_signature()),
            "rougeL_f1": sum(rouge) / n, "exact_match": sum(exact) / n, "count": n}  # fmt: skip


def run_template(run: Any, sp: Any) -> Any:
    """The lmtrain.chat template of a run of this toolkit's own models: the one its fine-tune recorded, else the
    one its tokenizer supports."""
    from lmtrain.chat import ChatTemplate, template_for

    return ChatTemplate.from_json(run.chat_template, "run.json") if run.chat_template else template_for(sp)


def chat_prompt(run: Any, sp: Any, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """(the ids to generate a reply from, the ids that end the reply) of a conversation ending with a user turn,
    through the run's chat template: a base model's own (tokbin.chat_prompt_ids, ended by its end-of-turn token),
    or the template a fine-tune of this toolkit's models trained with (lmtrain.chat)."""
    from lmtrain.text_codec import encode, is_base_tokenizer

    if is_base_tokenizer(sp):
        import tokbin

        messages = [{"role": role, "content": content} for role, content in turns]
        probe = tokbin.encode_chat(sp, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
        labelled = [i for i, label in zip(probe.ids, probe.labels, strict=True) if label != -100]
        ends = [labelled[-1], *([sp.eos_id] if sp.eos_id not in (None, labelled[-1]) else [])]
        return tokbin.chat_prompt_ids(sp, messages), ends
    template = run_template(run, sp)
    eos = run.eos_id
    stop = sp.piece_to_id(template.end) if template.name == "tokens" else eos
    return encode(sp, template.render(turns, add_generation_prompt=True)), [i for i in (stop, eos) if i is not None]


def longest_prompt(model: Any, run: Any) -> int:
    """The most prompt tokens generation takes without --force: 4 training contexts for ALiBi (it extrapolates, at a
    cost that grows with the square of the length), the model's own context for rotary positions."""
    return 4 * run.seq_len if model.config.position == "alibi" else model.config.context_length


def generate_answers(model: Any, sp: Any, run: Any, prompts: Sequence[Any], *, max_new_tokens: int,
                     temperature: float, seed: int | None, top_k: int | None, force: bool = False,
                     where: str = "--prompt") -> list[str]:  # fmt: skip
    """The model's answer to each prompt (chat prompts through the run's template, plain ones as text). Every prompt
    is encoded first: one longer than :func:`longest_prompt` is one LmtrainError before any generation, unless
    ``force``."""
    import torch

    from lmcore import generate
    from lmtrain.text_codec import decode, document_start, encode, is_base_tokenizer

    template = None if is_base_tokenizer(sp) else run_template(run, sp)
    plain = template is not None and template.name == "plain"
    device = next(model.parameters()).device
    encoded = []
    for n, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids, ends = encode(sp, prompt), [i for i in (run.eos_id,) if i is not None]
            start = document_start(sp, run.eos_id)
            if start is not None and model.config.document_separator is None:
                ids = [start, *ids]
        else:
            ids, ends = chat_prompt(run, sp, prompt)
        if len(ids) > longest_prompt(model, run) and not force:
            which = f"{where} (prompt {n + 1})" if len(prompts) > 1 else where
            raise LmtrainError(
                f"{which}: {len(ids):,} tokens, past the {longest_prompt(model, run):,} this model takes without "
                "--force (attention's time and memory grow with the square of the length): shorten the prompt, or "
                "add --force"
            )
        encoded.append((ids, ends))
    answers = []
    for i, (prompt, (ids, ends)) in enumerate(zip(prompts, encoded, strict=True)):
        out = generate(model, torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                       top_k=top_k, eos_id=ends[0] if ends else None,
                       seed=None if seed is None else seed + i)  # fmt: skip
        new = [int(t) for t in out[0, len(ids) :].tolist()]
        for end in ends:
            if end in new:
                new = new[: new.index(end)]
        text = decode(sp, new)
        if plain and template is not None and not isinstance(prompt, str):
            text = text.split(template.end)[0]  # the plain template's end of turn is text
        answers.append(text)
    return answers


def check_generation_settings(*, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse, in one line, settings ``lmcore.generate`` cannot sample with, before any model is loaded."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise LmtrainError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise LmtrainError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise LmtrainError(f"--top-k must be an integer >= 1 (sample from the k likeliest tokens), got {top_k}")


def limited(items: list[Any], limit: float | None) -> list[Any]:
    """The first ``limit`` items (a count >= 1), or that share of them (0 < limit < 1, rounded up), as ``--limit``
    counts for ``--tasks``; anything else is one LmtrainError.

    Example:
        >>> limited(list(range(10)), 5), limited(list(range(10)), 0.25), len(limited(list(range(10)), None))
        ([0, 1, 2, 3, 4], [0, 1, 2], 10)
    """
    if limit is None:
        return items
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise LmtrainError(f"--limit must be a count >= 1 or a fraction in (0, 1), got {limit}")
    if limit >= 1:
        if limit != int(limit):
            raise LmtrainError(f"--limit {limit}: a count of prompts must be a whole number (or a fraction below 1)")
        return items[: int(limit)]
    return items[: math.ceil(len(items) * limit)]


def evaluate_prompts(run_dir: str | os.PathLike, prompts_file: str | os.PathLike, out: str | os.PathLike | None = None,
                     *, checkpoint: str = "best", max_new_tokens: int = 256, temperature: float = 0.0,
                     seed: int | None = None, top_k: int | None = None, device: str | None = None,
                     limit: float | None = None, force: bool = False) -> dict[str, Any]:  # fmt: skip
    """Generate an answer to every prompt of ``prompts_file`` (the first ``limit``, see :func:`limited`) with the
    run's ``checkpoint`` and score them (module docstring); the prompts, references and generations go to ``out``
    (default ``RUN_DIR/generations-<checkpoint>.jsonl``). Returns the scores with the checkpoint and the output file.

    Everything that can be checked before the generation is: the settings, the prompts, that the output is not the
    prompts file, and that the output can be written (its temporary file is created first), so no generation is
    thrown away for a bad flag or an unwritable output."""
    from lmtrain.devices import resolve_device
    from lmtrain.run_files import load_tokenizer, load_trained_model

    require_scorers()
    check_generation_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)
    if out is not None:
        refuse_output_over_input(out, {"--prompts": prompts_file}, flag="--generations")
    items = limited(read_prompts(prompts_file), limit)
    where = resolve_device(device)
    model, run, path = load_trained_model(run_dir, str(where), checkpoint=checkpoint)
    target = Path(out) if out is not None else Path(run_dir) / f"generations-{path.name}.jsonl"
    refuse_output_over_input(target, {"--prompts": prompts_file}, flag="--generations")
    result = score_prompts(model, load_tokenizer(run_dir), run, items, target, max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed, top_k=top_k, force=force,
                           where=str(prompts_file))  # fmt: skip
    return result | {"checkpoint": str(path)}


def score_prompts(model: Any, sp: Any, run: Any, items: Sequence[tuple[Any, str]], target: Path, *,
                  max_new_tokens: int, temperature: float = 0.0, seed: int | None = None, top_k: int | None = None,
                  force: bool = False, where: str = "--prompts") -> dict[str, Any]:  # fmt: skip
    """Generate an answer to each (prompt, reference) of ``items`` with ``model`` and tokenizer ``sp``, score them
    (:func:`score`) and write every prompt, reference and generation to ``target``. ``run`` is the RunRecord whose
    chat template and EOS the prompts go through; None for chat prompts to a base model's own tokenizer, which
    brings its template (a Hugging Face directory that is no run: `lmtrain demo --finetune --base`)."""
    if run is None and any(isinstance(p, str) for p, _ in items):
        raise LmtrainError(f"{where}: plain-text prompts need a run's EOS; give chat prompts (messages)")
    with _generations_file(target) as f:  # opened before the generation: an output that cannot be written fails now
        answers = generate_answers(model, sp, run, [p for p, _ in items], max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed, top_k=top_k, force=force,
                                   where=where)  # fmt: skip
        references = [r for _, r in items]
        result = score(answers, references)
        for i, ((prompt, reference), answer) in enumerate(zip(items, answers, strict=True)):
            shown = prompt if isinstance(prompt, str) else [{"role": r, "content": c} for r, c in prompt]
            f.write(json.dumps({"id": i, "prompt": shown, "reference": reference, "generation": answer}) + "\n")
    return result | {"generations": str(target), "temperature": temperature, "seed": seed}


@contextlib.contextmanager
def _generations_file(target: Path) -> Iterator[Any]:
    """A temporary file beside ``target`` (never through a link), renamed over it when the block ends without an
    exception; a target that is a directory, or a place where nothing can be written, is one LmtrainError."""
    from trainloop.checkpoint import CheckpointError, open_new

    if target.is_dir():
        raise LmtrainError(f"--generations {target}: is a directory; name the JSONL file to write, e.g. "
                           f"{target / 'generations.jsonl'}")  # fmt: skip
    if not target.parent.is_dir():
        raise LmtrainError(f"--generations {target}: its directory {target.parent} does not exist; create it first")
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a leftover, or a link planted there: the link itself goes
        f = open_new(tmp)
    except CheckpointError as exc:
        raise LmtrainError(str(exc)) from None
    except OSError as exc:
        if exc.errno in WRITE_ERRNOS:
            raise LmtrainError(write_failure_message(exc, str(target))) from None
        raise LmtrainError(f"--generations {target}: cannot be written ({exc.strerror}); choose another path") from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in WRITE_ERRNOS:
            raise LmtrainError(write_failure_message(exc, str(target))) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_prompts(args: argparse.Namespace) -> int:
    """`lmtrain eval --prompts`: scores printed (one JSON object with ``--json``), generations written."""
    result = evaluate_prompts(args.run, args.prompts, args.generations, checkpoint=args.checkpoint,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              seed=args.generation_seed, top_k=args.top_k, device=args.device,
                              limit=getattr(args, "limit", None), force=getattr(args, "force", False))  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        n = result["count"]
        print(f"{args.prompts}: {n} prompts, BLEU-4 {result['bleu4']:.2f} (sacrebleu {result['bleu_signature']}, "
              f"n={n}), ROUGE-L F1 {result['rougeL_f1']:.4f} (n={n}), exact match {result['exact_match']:.4f} (n={n})"
              f"\ncheckpoint {result['checkpoint']}; generations in {result['generations']}")  # fmt: skip
    return 0
