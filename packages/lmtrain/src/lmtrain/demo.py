"""`lmtrain demo`: the whole path on this machine's own Python standard library source, no download.

corpus (stdlib .py files outside the test suites) -> prepare -> train cpu-small on CPU for --time-budget seconds
-> evaluate on held-out source -> print a sample -> loss plot. Everything lands under --out.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

from lmtrain.errors import LmtrainError

# Enough source for a few minutes of cpu-small (several epochs would need hours); a stride over the sorted
# files keeps the sample spread over the whole library.
DEMO_CORPUS_BYTES = 2_500_000
DEMO_VAL_FRACTION = 0.05
DEMO_EVAL_CHARS = 20_000  # held-out characters scored at the end (a full pass would outlast a short demo)
TINY_CORPUS_BYTES, TINY_VOCAB_SIZE = 100_000, 400  # tiny_data: prepared in about a second
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files outside test suites and installed packages, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (_SKIP_PARTS & set(p.relative_to(root).parts))]
    if not files:
        raise LmtrainError(f"no Python source under {root}: this Python ships without its standard library source")
    return sorted(files)


def build_corpus(out_file: Path, max_bytes: int = DEMO_CORPUS_BYTES) -> dict[str, int]:
    """Write about `max_bytes` of stdlib source into `out_file`, each file under a `# file:` line.

    Example:
        >>> import tempfile
        >>> out = tempfile.TemporaryDirectory()
        >>> corpus = Path(out.name) / "corpus.txt"
        >>> info = build_corpus(corpus, 1_000_000)
        >>> 0 < info["files"] < info["available_files"], info["bytes"] == corpus.stat().st_size
        (True, True)
        >>> corpus.read_text(encoding="utf-8").startswith("# file: ")
        True
        >>> out.cleanup()
    """
    files = stdlib_sources()
    sizes = [p.stat().st_size for p in files]
    stride = max(1, math.ceil(sum(sizes) / max_bytes))
    root = Path(sysconfig.get_paths()["stdlib"])
    written = used = 0
    with open(out_file, "w", encoding="utf-8") as out:
        for path in files[::stride]:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few files are in other encodings or unreadable: skip them
            chunk = f"# file: {path.relative_to(root)}\n{text}\n"
            out.write(chunk)
            written += len(chunk.encode("utf-8"))
            used += 1
            if written >= max_bytes:
                break
    return {"files": used, "bytes": written, "available_files": len(files)}


def tiny_data(directory: str | os.PathLike) -> Path:
    """``directory/data``: a little of the standard library's source (written to ``directory/input.txt``) prepared
    as `lmtrain prepare` does, with a tokenizer of 400 pieces. A real data directory in about a second, for examples.

    Example:
        >>> import json, tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> data = tiny_data(work.name)
        >>> json.loads((data / "meta.json").read_text())["vocab_size"], (data / "tokenizer.model").is_file()
        (400, True)
        >>> work.cleanup()
    """
    from lmtrain.prepare_data import prepare

    directory = Path(directory)
    build_corpus(directory / "input.txt", TINY_CORPUS_BYTES)
    prepare([directory / "input.txt"], directory / "data", vocab_size=TINY_VOCAB_SIZE, progress=False)
    return directory / "data"


def tiny_run(directory: str | os.PathLike, steps: int = 4) -> Path:
    """``directory/run``: the tiny preset without biases (so that it exports as MPT) trained ``steps`` steps on
    ``tiny_data(directory)``, evaluated and saved every 2 steps; the training log is not shown. Seconds on a CPU.

    Example:
        >>> import os, tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> run = tiny_run(work.name)
        >>> sorted(os.listdir(run / "checkpoints"))
        ['best.json', 'step_00000002', 'step_00000004']
        >>> work.cleanup()
    """
    from lmtrain.recipes import EXAMPLE_RECIPE
    from lmtrain.train_run import train

    data, run = tiny_data(directory), Path(directory) / "run"
    train(data, run, recipe=EXAMPLE_RECIPE, max_steps=steps, quiet=True,
          overrides={"bias": False, "eval_every": 2, "save_every": 2, "log_every": 1})  # fmt: skip
    return run


# Python source a model of this size learns to continue within minutes: a method header whose body is predictable.
DEMO_PROMPT = "class Point:\n    def __init__(self, x, y):\n        self."


def lmtrain_command() -> str:
    """How the user reaches this `lmtrain` from their shell: ``lmtrain`` when that name on PATH is this one, else
    the path of the script that is running, or of this environment's script (a nox or virtual environment that is
    not activated), else ``python -m lmtrain`` with this interpreter.
    """
    import shlex
    import shutil
    import sys

    running = Path(sys.argv[0]) if sys.argv and Path(sys.argv[0]).name == "lmtrain" else None
    beside = Path(sys.executable).parent / "lmtrain"
    found = shutil.which("lmtrain")
    for script in (running, beside):
        if script is not None and script.is_file():
            if found is not None and Path(found).resolve() == script.resolve():
                return "lmtrain"
            return shlex.quote(str(script.resolve()))
    return f"{shlex.quote(sys.executable)} -m lmtrain"


def run_demo(args: argparse.Namespace) -> int:
    """The `lmtrain demo` command."""
    import shlex
    import sys

    import torch

    from lmcore import GPT, ModelConfig
    from lmtrain.evaluate import evaluate_text
    from lmtrain.prepare_data import prepare
    from lmtrain.recipes import DEFAULT_RECIPE
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.sample import continue_text
    from lmtrain.train_run import train

    if not math.isfinite(args.time_budget) or args.time_budget <= 0:
        raise LmtrainError(f"--time-budget must be a finite number of seconds > 0, got {args.time_budget}")
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
    summary = train(data, run, recipe=DEFAULT_RECIPE, time_budget_s=args.time_budget, overwrite=True)
    model, run_info, checkpoint = load_trained_model(run)
    sp = load_tokenizer(run)
    # The same model before training: the run's configuration and seed give its step-0 weights.
    torch.manual_seed(int(run_info["train_config"]["seed"]))
    untrained = GPT(ModelConfig.from_dict(run_info["model_config"])).eval()
    val_text = (data / "val.txt").read_text(encoding="utf-8")[:DEMO_EVAL_CHARS]
    seq_len, eos_id = run_info["data_config"]["seq_len"], run_info.get("eos_id")
    scores = [evaluate_text(m, sp, val_text, context=seq_len, stride=seq_len // 2, eos_id=eos_id)["bits_per_byte"]
              for m in (untrained, model)]  # fmt: skip
    print(f"[4/5] eval on held-out source ({len(val_text):,} characters never trained on): {scores[1]:.3f} bits "
          f"per byte after training, {scores[0]:.3f} before ({checkpoint.name})", flush=True)  # fmt: skip
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
        f"  {command} export --run {shlex.quote(str(run))} --out {shlex.quote(str(out / 'hf'))}"
    )
    return 0
