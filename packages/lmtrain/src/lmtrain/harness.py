"""`lmtrain eval --tasks`: a run's model on lm-evaluation-harness tasks (HellaSwag, ARC, LAMBADA, WikiText, ...).

The model runs in this process, on `--device` in `--dtype`, behind the harness's own model interface
(`lm_eval.api.model.TemplateLM`): the harness builds the requests, few-shot contexts and metrics; `RunLM` scores
them with the checkpoint and the run's tokenizer, encoded as `lmtrain eval` and training encode text. Every
request starts a document as training saw one: the document-start token (the end-of-document id, also the
harness's prefix token) goes in front of its context, as `lmtrain generate` puts it in front of a prompt. Inputs
hold at most `max_length` tokens (default: the training context), cut from the left.

What the harness's perplexity task metrics are, against `lmtrain eval --text` on the same text (a one-document
task scored with `--stride` equal to `--context`: the harness's disjoint windows), from the same summed NLL:
- `bits_per_byte` = `bits_per_byte` (both: NLL / ln 2 / UTF-8 bytes); `byte_perplexity` = 2 ** `bits_per_byte`.
- `word_perplexity` = exp(NLL / words) with words = `len(re.split(r"\\s+", text))`, where `lmtrain eval` counts
  whitespace-separated words plus one per line end: `word_ppl` ** (ours / theirs) is the harness's figure.
- The harness scores each document of a task on its own (prefix, then windows from its start).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmtrain.errors import WRITE_ERRNOS, LmtrainError, write_failure_message

HARNESS_DIR = "lm-eval"  # RUN_DIR/lm-eval/<checkpoint>-<tasks>/ by default
_TASK_MANAGERS: dict[str | None, Any] = {}


def import_harness() -> Any:
    """lm_eval, or a one-line LmtrainError naming the extra that installs it."""
    try:
        import lm_eval
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "lm_eval":
            raise
        from lmcore.extras import install_hint

        raise LmtrainError(
            f"--tasks needs lm-evaluation-harness, which is not installed: {install_hint('harness', 'lmtrain')}"
        ) from None
    return lm_eval


def task_manager(include_path: str | None) -> Any:
    """The harness's TaskManager over its own tasks and those under `include_path` (indexing takes seconds: one
    per process and path)."""
    if include_path not in _TASK_MANAGERS:
        from lm_eval.tasks import TaskManager

        if include_path is not None and not Path(include_path).is_dir():
            raise LmtrainError(f"--include-path {include_path}: not a directory of task YAML files")
        _TASK_MANAGERS[include_path] = TaskManager(include_path=include_path)
    return _TASK_MANAGERS[include_path]


def check_tasks(names: list[str], manager: Any) -> None:
    """Refuse, in one line, a task, group or tag name the harness does not know, with its near matches."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(near)}?" if near else "`lm-eval ls tasks` lists them"
            raise LmtrainError(f"--tasks {name!r}: not a task, group or tag of lm-evaluation-harness; {hint}")


def build_tasks(names: list[str], manager: Any, include_path: str | None) -> None:
    """Build the harness's task objects once (their configs checked, their datasets loaded), so that a broken task
    is one LmtrainError naming it, before any model is loaded: an ``output_type`` the harness does not know, a data
    file that is missing, a dataset neither cached nor reachable, a package the task needs."""
    where = f" under --include-path {include_path}" if include_path else ""
    try:
        manager.load(names)
    except ConnectionError as exc:  # what `datasets` raises for a dataset it can neither download nor find cached
        raise LmtrainError(
            f"--tasks {','.join(names)}: a task's dataset could not be loaded ({exc}); run once where the Hugging Face "
            "Hub is reachable (datasets caches it under HF_DATASETS_CACHE), or use local task files (--include-path)"
        ) from None
    except ImportError as exc:
        raise LmtrainError(f"--tasks {','.join(names)}: a task needs {exc.name or exc}, which is not installed: "
                           f"pip install {exc.name or 'it'}") from None  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise LmtrainError(f"--tasks {','.join(names)}: a task could not be built ({type(exc).__name__}: {first}); "
                           f"fix its YAML{where} or its data files") from None  # fmt: skip


def _base() -> type:
    import_harness()
    from lm_eval.api.model import TemplateLM

    return TemplateLM


def run_lm(model: torch.nn.Module, sp: Any, eos_id: int, max_length: int, batch_size: int = 8) -> Any:
    """A `lm_eval.api.model.TemplateLM` that scores with `model` (on its device and dtype) and tokenizes with `sp`.

    Example (needs the harness extra; an untrained tiny model scores about ln(vocab) nats per token):
        >>> import tempfile, math
        >>> import sentencepiece as spm
        >>> from lmtrain.examples import tiny_data
        >>> from lmcore import GPT, ModelConfig
        >>> work = tempfile.TemporaryDirectory()
        >>> sp = spm.SentencePieceProcessor(model_file=str(tiny_data(work.name) / "tokenizer.model"))
        >>> lm = run_lm(GPT(ModelConfig.from_preset("tiny", vocab_size=400)).eval(), sp, eos_id=2, max_length=32)
        >>> from lm_eval.api.instance import Instance
        >>> [(logprob, greedy)] = lm.loglikelihood([Instance("loglikelihood", {}, ("def f", "(x):"), 0)])
        >>> -8 * len(lm.tok_encode("(x):")) < logprob < 0, greedy
        (True, False)
        >>> work.cleanup()
    """
    from lmtrain.text_codec import decode, encode

    base = _base()

    class RunLM(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model, self.sp, self._eos, self.max_length, self.batch_size = model, sp, eos_id, max_length, batch_size
            self._device = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self._eos

        @property
        def prefix_token_id(self) -> int:
            return self._eos  # the document start of training

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return encode(self.sp, string)

        def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
            return decode(self.sp, tokens)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            return score_continuations(self.model, requests, self._eos, self.max_length, self.batch_size)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            from lm_eval import utils

            out = []
            for (string,) in [req.args for req in requests]:
                windows = [
                    (None, *utils.make_disjoint_window(w))
                    for w in utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                out.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(windows)))
            return out

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            return [generate_greedily(self, *req.args) for req in requests]

    return RunLM()


@torch.no_grad()
def score_continuations(model: torch.nn.Module, requests: list, eos_id: int, max_length: int, batch_size: int) -> list:
    """(log-likelihood, greedy) of each request's continuation after its context (lists of ids), as the harness's
    ``_loglikelihood_tokens`` returns them. Every request starts a document (``eos_id`` first), as in training; the
    longest go first, so that a batch's rows are of similar length; right padding leaves a causal model's earlier
    positions unchanged."""
    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        rows = []
        for i in order[start : start + batch_size]:
            _, context, continuation = requests[i]
            if not continuation:
                raise ValueError("the harness asked for the likelihood of an empty continuation")
            if not context or context[0] != eos_id:
                context = [eos_id, *context]
            whole = (list(context) + list(continuation))[-(max_length + 1) :]
            rows.append((i, whole[:-1], len(continuation)))
        width = max(len(inp) for _, inp, _ in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (_, inp, _) in enumerate(rows):
            batch[r, : len(inp)] = torch.tensor(inp)
        logprobs = F.log_softmax(model(batch.to(device)).logits.float(), dim=-1)  # (B, T, V)
        for r, (i, inp, n) in enumerate(rows):
            target = torch.tensor(list(requests[i][2])[-n:], device=device)
            scores = logprobs[r, len(inp) - n : len(inp)]  # (n, V): the positions predicting the continuation
            picked = scores.gather(1, target[:, None]).squeeze(1)
            results[i] = (float(picked.double().sum()), bool((scores.argmax(-1) == target).all()))
    return results


@torch.no_grad()
def generate_greedily(lm: Any, context: str, gen_kwargs: dict[str, Any]) -> str:
    """The harness's ``generate_until`` for one request: greedy tokens after ``context`` (a document start first),
    cut at the end of a document and at the first of the request's ``until`` strings; sampling is refused."""
    from lmcore import generate

    kwargs = dict(gen_kwargs)
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    max_new = int(kwargs.get("max_gen_toks", 256))
    if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise ValueError("lmtrain eval --tasks generates greedily; the task asks for sampling")
    ids = ([lm.eot_token_id] + lm.tok_encode(context))[-max(1, lm.max_length - max_new) :]
    tokens = generate(
        lm.model,
        torch.tensor([ids], device=next(lm.model.parameters()).device),
        max_new,
        temperature=0,
        eos_id=lm.eot_token_id,
    )
    new = [int(t) for t in tokens[0, len(ids) :].tolist()]
    if lm.eot_token_id in new:
        new = new[: new.index(lm.eot_token_id)]
    text = lm.tok_decode(new)
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


def _output_dir(args: argparse.Namespace, checkpoint: Path | None, tasks: list[str]) -> Path:
    if args.out is not None:
        return Path(args.out)
    name = f"{checkpoint.name if checkpoint else args.checkpoint}-{'+'.join(tasks)}"
    return Path(args.run) / HARNESS_DIR / (name + (f"-limit{args.limit:g}" if args.limit is not None else ""))


# Flags of `lmtrain eval` that belong to one mode only: (flag, attribute, value when not given).
TASK_FLAGS = [
    ("--limit", "limit", None),
    ("--num-fewshot", "num_fewshot", None),
    ("--include-path", "include_path", None),
    ("--batch-size", "batch_size", None),
    ("--bootstrap-iters", "bootstrap_iters", 100000),
    ("--out", "out", None),
]
TEXT_FLAGS = [
    ("--stride", "stride", None),
    ("--json", "json", False),
    ("--repeat", "repeat", 1),
    ("--seeds", "seeds", None),
]


def check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, a flag of the other mode (`--text` or `--tasks`) instead of ignoring it."""
    tasks = getattr(args, "tasks", None) is not None
    for flag, attribute, unset in TEXT_FLAGS if tasks else TASK_FLAGS:
        if getattr(args, attribute, unset) != unset:
            raise LmtrainError(f"{flag} applies to {'--text' if tasks else '--tasks'} only; drop it")


def run_tasks(args: argparse.Namespace) -> int:
    """`lmtrain eval --tasks`: the harness's table on stdout; results.json and results.md in the output directory
    (written beside it and renamed into place: an existing one is refused, nothing is written on an error)."""
    from lmtrain.devices import resolve_device, resolve_dtype
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from trainloop.distributed import env_world

    check_mode_flags(args)
    lm_eval = import_harness()
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise LmtrainError(f"--tasks {args.tasks!r}: expected task names separated by commas, e.g. hellaswag,arc_easy")
    if env_world()[2] > 1:
        raise LmtrainError("--tasks runs in one process: start it without torchrun")
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size), ("--context", args.context)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise LmtrainError(f"{flag} must be a finite number > 0, got {value}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise LmtrainError(f"--num-fewshot must be >= 0 (examples put before each question), got {args.num_fewshot}")
    if args.out is not None and Path(args.out).exists():
        raise LmtrainError(f"--out {args.out}: exists; choose a new directory (results are never overwritten)")
    manager = task_manager(args.include_path)
    check_tasks(tasks, manager)
    build_tasks(tasks, manager, args.include_path)  # a task's YAML or data that cannot work fails before the model
    device = resolve_device(args.device)
    model, run, checkpoint = load_trained_model(
        args.run, str(device), checkpoint=args.checkpoint, verify=args.verify, dtype=resolve_dtype(args.dtype, device),
        on_note=lambda note: print(f"lmtrain eval: {note}", file=sys.stderr),
    )  # fmt: skip
    out = _output_dir(args, checkpoint, tasks)
    if out.exists():
        raise LmtrainError(f"{out}: exists; pass --out DIR for a new directory (results are never overwritten)")
    eos_id = run.eos_id
    if not isinstance(eos_id, int) or eos_id < 0:
        raise LmtrainError(f"{args.run}/run.json: eos_id {eos_id!r}: the harness needs the document-start token id")
    context = args.context if args.context is not None else run.seq_len
    lm = run_lm(model, load_tokenizer(args.run), eos_id, context, args.batch_size or 8)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, task_manager=manager,
            bootstrap_iters=args.bootstrap_iters, log_samples=False,
        )  # fmt: skip
    except ConnectionError as exc:  # what `datasets` raises for a dataset it can neither download nor find cached
        raise LmtrainError(
            f"--tasks {args.tasks}: a task's dataset could not be loaded ({exc}); run once where the Hugging Face "
            "Hub is reachable (datasets caches it under HF_DATASETS_CACHE), or use local task files (--include-path)"
        ) from None
    table = lm_eval.utils.make_table(results)
    if "groups" in results:
        table += "\n" + lm_eval.utils.make_table(results, "groups")
    results["lmtrain"] = {
        "run": str(args.run), "checkpoint": str(checkpoint), "device": str(device), "dtype": args.dtype,
        "max_length": context, "prefix_token_id": eos_id,
    }  # fmt: skip
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        text = json.dumps(results, indent=2, default=lm_eval.utils.handle_non_serializable, ensure_ascii=False)
        (tmp / "results.json").write_text(text + "\n", encoding="utf-8")
        (tmp / "results.md").write_text(table, encoding="utf-8")
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            raise LmtrainError(write_failure_message(exc, str(out))) from None
        raise
    print(table)
    print(f"checkpoint {checkpoint}, {device} {args.dtype}, windows of {context} tokens; results in {out}")
    return 0
