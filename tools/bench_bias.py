"""Biases or none: cpu-small trained on TinyShakespeare with and without biases, same seeds, data and steps.

    python tools/bench_bias.py [--steps 200] [--seeds 0 1 2] [--preset cpu-small] [--workdir DIR]

The question it answers: can the GPU presets drop their biases, so that the reference model exports as
transformers' MPT with no custom code, without costing quality? For each seed, `lmtrain train --preset cpu-small`
(or `--preset`, e.g. 125m on a GPU host) runs twice for the same number of steps, `--set bias=true` and
`--set bias=false`, with that seed for the initialisation (biases start at zero, so both models start from the same
weights) and for the batches (the same order in both). Each final checkpoint is then evaluated on the whole
validation text (`lmtrain eval`, sliding windows). Prints per seed the validation loss of both and their
difference, then the mean difference and its standard deviation over the seeds, and the training tokens/s of each
variant (measured back to back on a shared CPU, so their ratio moves with the load printed beside it).

nanoGPT's split of TinyShakespeare and `lmtrain prepare` with its defaults, as tools/bench_shakespeare.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from bench_shakespeare import lmtrain, prepare_split


def train_and_eval(
    data: str, run: str, val_txt: str, preset: str, steps: int, seed: int, bias: bool
) -> tuple[float, float]:
    """(validation loss in nats per token, training tokens/s) of one run."""
    train, _ = lmtrain(
        "train", "--json", "--data", data, "--out", run, "--preset", preset, "--max-steps", str(steps),
        "--set", f"bias={str(bias).lower()}", "--set", f"seed={seed}", "--set", f"save_every={steps}",
        "--set", "eval_every=0",
    )  # fmt: skip
    summary = json.loads(train.stdout.strip().splitlines()[-1])["summary"]
    ev, _ = lmtrain("eval", "--run", run, "--text", val_txt, "--json", "--checkpoint", "latest")
    return json.loads(ev.stdout.strip().splitlines()[-1])["loss"], summary["tokens_seen"] / summary["wall_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--preset", default="cpu-small", help="lmcore preset to train (default cpu-small)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", default=None, help="keep data and runs here (default: a temporary directory)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    prepared = prepare_split(args.workdir, "bench-bias-")
    if prepared is None:
        return 0
    data = str(prepared.work / "data")
    rows, speed = [], {True: [], False: []}
    for seed in args.seeds:
        losses = {}
        for bias in (True, False):
            run = str(prepared.work / f"run-seed{seed}-bias{int(bias)}")
            losses[bias], tokens_per_s = train_and_eval(
                data, run, str(prepared.val_txt), args.preset, args.steps, seed, bias
            )
            speed[bias].append(tokens_per_s)
        rows.append((seed, losses[True], losses[False], losses[False] - losses[True]))
        print(f"seed {seed}: val loss with biases {losses[True]:.4f}, without {losses[False]:.4f}, "
              f"difference (without - with) {losses[False] - losses[True]:+.4f} nats/token", flush=True)  # fmt: skip
    diffs = [r[3] for r in rows]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    with_bias, without = statistics.fmean(speed[True]), statistics.fmean(speed[False])
    print(f"mean difference over {len(diffs)} seed(s): {statistics.fmean(diffs):+.4f} nats/token (std {spread:.4f}); "
          f"mean val loss with biases {statistics.fmean(r[1] for r in rows):.4f}, "
          f"without {statistics.fmean(r[2] for r in rows):.4f}")  # fmt: skip
    print(f"training tokens/s: with biases {with_bias:,.0f}, without {without:,.0f} (ratio {without / with_bias:.3f})")
    load_after = os.getloadavg()
    print(f"{args.preset}, {args.steps} steps per run; load average before / after (2 cores): "
          f"{load_before[0]:.1f} / {load_after[0]:.1f}; work directory {prepared.work}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
