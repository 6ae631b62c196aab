"""ALiBi or RoPE for pretraining, measured: the same small model trained both ways at equal steps on CPU, each
evaluated at 1x, 2x and 4x its training context (and RoPE again with dynamic NTK scaling, no retraining).

    python tools/bench_positions.py [--steps 1500] [--workdir DIR] [--corpus-mb 2.5]

The corpus is this machine's Python standard-library source (`lmtrain.demo.build_corpus`), prepared by
`lmtrain.prepare` with its defaults (a 2048-piece BPE; a tenth of the files held out by hash). Both runs are
`lmtrain.train(recipe="cpu-small", max_steps=STEPS)` with `overrides={"position": "alibi" | "rope"}` and otherwise
the same settings, fixed so that the runs cannot differ by a planner's choice: bf16 autocast, the same seed, the same
batches. Evaluation reads the held-out token file in consecutive windows of L, 2L and 4L tokens (L = 128, the
training context) over the same tokens for every length, and reports the mean loss per token (nats) over all
positions, and over the positions at or past L only (what only extrapolation reaches). RoPE with dynamic NTK is the
trained RoPE model with `rope_scaling="dynamic"` (`rope_original_context=L`; factor 1 and 2), transformers' rule:
the base grows with the window length past L. Prints a markdown table, the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
EVAL_BATCH = 8


def cpu_model() -> str:
    text = Path("/proc/cpuinfo").read_text()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def commit() -> str:
    result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or "?"


@torch.no_grad()
def window_losses(model, tokens: np.ndarray, length: int, context: int) -> tuple[float, float]:
    """(mean loss over every target, mean over targets at positions >= context) for consecutive windows."""
    n = (len(tokens) - 1) // length
    inputs = torch.from_numpy(tokens[: n * length].astype(np.int64)).view(n, length)
    targets = torch.from_numpy(tokens[1 : n * length + 1].astype(np.int64)).view(n, length)
    total = beyond = 0.0
    count = beyond_count = 0
    for start in range(0, n, EVAL_BATCH):
        x, y = inputs[start : start + EVAL_BATCH], targets[start : start + EVAL_BATCH]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        nll = nll.view(y.shape)
        total += float(nll.sum())
        count += nll.numel()
        if length > context:
            beyond += float(nll[:, context:].sum())
            beyond_count += nll[:, context:].numel()
    return total / count, (beyond / beyond_count if beyond_count else math.nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps per model (default 1500)")
    parser.add_argument("--workdir", help="where the corpus, data and runs go (default: a new temporary directory)")
    parser.add_argument("--corpus-mb", type=float, default=2.5, help="megabytes of standard-library source")
    args = parser.parse_args()

    import lmtrain
    from lmcore import GPT
    from lmtrain.demo import build_corpus
    from lmtrain.run_files import load_trained_model
    from tokbin import TokenFile

    os.environ.setdefault("TQDM_DISABLE", "1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-positions-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = load()
    print(f"{cpu_model()}; load average {load_before} before; commit {commit()}; work {work}", flush=True)
    corpus = build_corpus(work / "input.txt", int(args.corpus_mb * 1e6))
    data = work / "data"
    if not (data / "meta.json").is_file():
        lmtrain.prepare([work / "input.txt"], data, progress=False)
    meta = json.loads((data / "meta.json").read_text())
    print(f"corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.2f} MB; train {meta['train']['tokens']:,} "
          f"tokens, held out {meta['val']['tokens']:,}", flush=True)  # fmt: skip

    common = {"precision": "bf16", "seed": 0, "eval_every": 0, "save_every": args.steps, "log_every": 100}
    runs, train_info = {}, {}
    for position in ("alibi", "rope"):
        run = work / f"run-{position}"
        start, cpu0 = time.perf_counter(), time.process_time()
        summary = lmtrain.train(data, run, recipe="cpu-small", max_steps=args.steps, overwrite=True, quiet=True,
                                overrides={**common, "position": position})  # fmt: skip
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        runs[position] = run
        train_info[position] = (summary.step, wall, cpu)
        print(f"trained {position}: {summary.step} steps in {wall:.0f} s ({cpu:.0f} CPU s)", flush=True)

    val = TokenFile(data / "val.bin")
    context = json.loads((runs["alibi"] / "run.json").read_text())["model_config"]["context_length"]
    lengths = [context, 2 * context, 4 * context]
    tokens = np.asarray(val.tokens)
    tokens = tokens[: (len(tokens) - 1) // (4 * context) * 4 * context + 1]  # the same targets at every length
    models = {}
    for position, run in runs.items():
        model, _, _ = load_trained_model(run, checkpoint="latest")
        models[position] = model.eval()
    rope = models["rope"]
    for factor in (1.0, 2.0):
        config = dataclasses.replace(rope.config, rope_scaling="dynamic", rope_factor=factor,
                                     rope_original_context=context)  # fmt: skip
        dynamic = GPT(config).eval()
        dynamic.load_state_dict(rope.state_dict())
        models[f"rope + dynamic NTK (factor {factor:g})"] = dynamic

    results = {name: [window_losses(m, tokens, n, context) for n in lengths] for name, m in models.items()}
    load_after = load()
    print(f"\n{len(tokens) - 1:,} held-out target tokens at each length; training context L = {context}; "
          f"load average {load_before} before, {load_after} after\n")  # fmt: skip
    print("| positions | steps | train s (CPU s) | loss @ L | @ 2L | @ 4L | past L @ 2L | past L @ 4L |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        base = name.split(" ")[0]
        steps, wall, cpu = train_info[base]
        trained = f"{wall:.0f} ({cpu:.0f})" if name in train_info else "(the rope run)"
        cells = [
            f"{rows[0][0]:.4f}",
            f"{rows[1][0]:.4f}",
            f"{rows[2][0]:.4f}",
            f"{rows[1][1]:.4f}",
            f"{rows[2][1]:.4f}",
        ]
        print(f"| {name} | {steps} | {trained} | {' | '.join(cells)} |")
    ratio = results["rope"][0][0] / results["alibi"][0][0]
    print(f"\nloss at L, RoPE / ALiBi: {ratio:.4f}; at 4L: {results['rope'][2][0] / results['alibi'][2][0]:.4f}")


if __name__ == "__main__":
    main()
