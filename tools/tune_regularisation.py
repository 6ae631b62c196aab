"""What a `cpu-small` run needs when its budget buys many passes over a small training file: dropout, weight decay,
model width and the best checkpoint against the last, compared at a fixed number of optimizer steps.

    python tools/tune_regularisation.py --corpus wikitext [--steps 1400] [--work DIR] [--jobs 2]
    python tools/tune_regularisation.py --corpus shakespeare --row dropout=0.2 --row dropout=0.2,width=192
    python tools/tune_regularisation.py --corpus shakespeare-headline --row dropout=0      # a check, never a choice

Each row trains `lmtrain train --preset cpu-small --max-steps N` with one CPU thread (`--set cpu_threads=1`) and the
schedule a `--time-budget` run gets (30 warmup steps, a constant learning rate, a linear decay over the last 40% of
the steps to a tenth of the peak, an evaluation every twelfth of the run on the validation split with the best
checkpoint kept), the row's dropout, weight decay and width set with `--set`. N defaults to 1400, the steps a 260 s
budget buys on an idle 2-core machine (the TinyShakespeare headline runs of docs/benchmarks.md reached 1294 and
1426). A row of another width trains for N times the CPU time of a width-128 step over its own (timed here first, on
one thread), so every row gets the same computation. Steps, not seconds, fix the work: the result does not depend
on how loaded the machine is; the load average is printed with each row.

Then `lmtrain eval --json` scores the tuning validation text in sliding windows with the best checkpoint and with
the last one. Corpora (files under `../shared/data` beside the repository):

- `wikitext`: WikiText-2's validation split cut as tools/bench_wikitext.py cuts it (the last 10% of the articles are
  report text, never read here; of the rest every 20th article validates, the others train); figure: word-level
  perplexity (words split on whitespace plus one end-of-line per line).
- `shakespeare`: the first 90% of TinyShakespeare's characters, the headline's training text; its last 5% of the
  file (characters 85-90%) validate, the first 85% train. The headline's validation text (the last 10%) is not read.
  Figure: bits per character.
- `shakespeare-headline`: the headline's own split (first 90% train, last 10% validate), to check a chosen setting
  against the headline; nothing is chosen on it.

Rows are appended to WORK/results.jsonl as they finish; a rerun with the same WORK skips rows already there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_shakespeare import DATA as SHAKESPEARE
from bench_wikitext import DATA as WIKITEXT
from bench_wikitext import closed_vocabulary, make_splits
from tune_cpu_small import cpu_seconds_per_step

# A row: dropout, weight decay (AdamW, matrices only), width (4 heads, MLP 4 x width, 4 layers, context 128), seed,
# tokenizer vocabulary (0: `lmtrain prepare`'s default), micro batch (rows of 128 tokens per step).
DEFAULT_ROW = {"dropout": 0.0, "weight_decay": 0.1, "width": 128, "seed": 0, "vocab": 0, "batch": 16}
GRID = [
    {},
    {"dropout": 0.1},
    {"dropout": 0.2},
    {"dropout": 0.3},
    {"weight_decay": 0.3},
    {"weight_decay": 1.0},
]
WARMUP_STEPS = 30
DECAY_FRACTION = 0.4  # trainloop.BUDGET.decay_fraction: what a --time-budget run decays over
EVALS_PER_RUN = 12  # a --time-budget run evaluates every twelfth of its budget
SEQ_LEN = 128  # the cpu-small recipe
BATCH = DEFAULT_ROW["batch"]


def parse_row(spec: str) -> dict[str, float]:
    """`dropout=0.2,weight_decay=0.3,width=192` -> a full row (unnamed fields keep their defaults)."""
    row = dict(DEFAULT_ROW)
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in row:
            raise SystemExit(f"tune_regularisation: error: --row {spec!r}: expected key=value with key in {list(row)}")
        row[key] = int(value) if key in ("width", "seed", "vocab", "batch") else float(value)
    return row


def row_name(row: dict[str, float]) -> str:
    name = f"d{row['dropout']:g}-wd{row['weight_decay']:g}-w{row['width']}"
    name += f"-s{row['seed']}" if row["seed"] else ""
    name += f"-v{row['vocab']}" if row["vocab"] else ""
    return name + (f"-b{row['batch']}" if row["batch"] != DEFAULT_ROW["batch"] else "")


def prepare(corpus: str, work: Path, vocab: int = 0) -> tuple[Path, Path, int]:
    """(data directory, tuning validation text, its characters) for `corpus`, prepared once by `lmtrain prepare`
    (with `--vocab-size vocab` unless 0). For WikiText the validation text is also written with the words its
    training text lacks replaced by `<unk>` (texts/val.closed.txt): what a word-level model such as
    tools/bench_wikitext.py's LSTM reference scores."""
    texts = work / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    if corpus == "wikitext":
        paths = make_splits(texts)
        (texts / "report.txt").unlink()  # report text: never used to choose anything
        train, val = paths["train"], paths["val"]
        closed_vocabulary(val, train, texts / "val.closed.txt")
    else:
        text = SHAKESPEARE.read_text(encoding="utf-8")
        cut = int(len(text) * 0.9)  # the headline's split
        if corpus == "shakespeare":
            parts = text[: int(len(text) * 0.85)], text[int(len(text) * 0.85) : cut]
        else:
            parts = text[:cut], text[cut:]
        train, val = texts / "train.txt", texts / "val.txt"
        train.write_text(parts[0], encoding="utf-8")
        val.write_text(parts[1], encoding="utf-8")
    data = work / (f"data-v{vocab}" if vocab else "data")
    if not (data / "meta.json").is_file():
        sizes = ["--vocab-size", str(vocab)] if vocab else []
        lmtrain("prepare", "--text", str(train), "--val-text", str(val), "--out", str(data), *sizes)
    return data, val, len(val.read_text(encoding="utf-8"))


def lmtrain(*args: str) -> str:
    env = dict(os.environ, TQDM_DISABLE="1")
    result = subprocess.run([sys.executable, "-m", "lmtrain", *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"lmtrain {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}"
                         f"{result.stderr[-3000:]}")  # fmt: skip
    return result.stdout


def train_and_score(row: dict[str, float], steps: int, data: Path, val: Path, val_chars: int, run: Path) -> dict:
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    width = row["width"]
    out = lmtrain(
        "train", "--json", "--data", str(data), "--out", str(run), "--preset", "cpu-small", "--max-steps", str(steps),
        "--overwrite", "--set", "cpu_threads=1", "--set", "schedule=wsd", "--set", f"warmup_steps={WARMUP_STEPS}",
        "--set", f"wsd_decay_steps={int(DECAY_FRACTION * steps)}", "--set", f"eval_every={steps // EVALS_PER_RUN}",
        "--set", "log_every=10", "--set", f"dropout={row['dropout']}", "--set", f"weight_decay={row['weight_decay']}",
        "--set", f"d_model={width}", "--set", f"d_ff={4 * width}", "--set", f"seed={row['seed']}",
        "--set", f"micro_batch={row['batch']}",
    )  # fmt: skip
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r["loss"] for r in records if "loss" in r and r.get("step", 0) > 0.9 * steps]  # the last 10% of steps
    result = {"row": row_name(row), **row, "steps": summary["step"], "train_loss": sum(last) / len(last),
              "best_step": (summary.get("best") or {}).get("step"), "train_s": time.perf_counter() - t0,
              "eval_curve": [[r["step"], round(r["eval_loss"], 4)] for r in records if "eval_loss" in r]}  # fmt: skip
    for which in ("best", "latest"):
        ev = json.loads(lmtrain("eval", "--run", str(run), "--text", str(val), "--json", "--checkpoint", which))
        result[which] = {"loss": ev["loss"], "word_ppl": ev["word_ppl"],
                         "bits_per_char": ev["bits_per_byte"] * ev["bytes"] / val_chars}  # fmt: skip
    score_closed(result, run, val)
    result["load"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
    return result


def score_closed(result: dict, run: Path, val: Path) -> None:
    """Add the closed-vocabulary word perplexity of the best and the last checkpoint (WikiText only)."""
    closed = val.with_name("val.closed.txt")
    for which in ("best", "latest"):
        if closed.is_file() and "closed_word_ppl" not in result[which]:
            ev = json.loads(lmtrain("eval", "--run", str(run), "--text", str(closed), "--json", "--checkpoint", which))
            result[which]["closed_word_ppl"] = ev["word_ppl"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", choices=("wikitext", "shakespeare", "shakespeare-headline"), required=True)
    parser.add_argument("--steps", type=int, default=1400, help="optimizer steps of a width-128 row (default 1400)")
    parser.add_argument("--row", action="append", default=None, help="e.g. dropout=0.2,weight_decay=0.3,width=192 "
                        "(repeatable; default: the built-in grid)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time (default 2)")
    parser.add_argument("--work", default=None, help="work directory (default /tmp/tune-regularisation-CORPUS)")
    parser.add_argument("--report", action="store_true", help="print WORK/results.jsonl as one table; train nothing")
    args = parser.parse_args()
    if args.report:  # closed-vocabulary figures missing from rows of an older version of this script are added
        work = Path(args.work or f"/tmp/tune-regularisation-{args.corpus}")
        results = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
        print(HEADER + "\n" + " | ".join(["---"] * (HEADER.count("|") + 1)))
        for r in results:
            run = work / "runs" / f"{r['row']}-{r['planned_steps']}"
            if run.is_dir():
                score_closed(r, run, work / "texts" / "val.txt")
            print(format_row(r))
        (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        return 0
    source = WIKITEXT if args.corpus == "wikitext" else SHAKESPEARE
    if not source.is_file():
        print(f"skipped: {source} is absent (expected ../shared/data next to the repository root)")
        return 0
    work = Path(args.work or f"/tmp/tune-regularisation-{args.corpus}")
    rows = [parse_row(spec) for spec in args.row] if args.row else [{**DEFAULT_ROW, **g} for g in GRID]
    prepared = {v: prepare(args.corpus, work, v) for v in sorted({0} | {r["vocab"] for r in rows})}
    metas = {v: json.loads((p[0] / "meta.json").read_text()) for v, p in prepared.items()}
    shapes = sorted({(128, 0, BATCH)} | {(r["width"], r["vocab"], r["batch"]) for r in rows})
    costs = {(w, v, b): cpu_seconds_per_step(w, 4, SEQ_LEN, b, metas[v]["vocab_size"]) for w, v, b in shapes}
    results_file = work / "results.jsonl"
    done = {}
    if results_file.is_file():
        done = {(r["row"], r["planned_steps"]): r for r in map(json.loads, results_file.read_text().splitlines())}

    def one(row: dict[str, float]) -> dict:
        steps = round(args.steps * costs[128, 0, BATCH] / costs[row["width"], row["vocab"], row["batch"]])
        key = (row_name(row), steps)
        if key in done:
            return done[key]
        data, val, val_chars = prepared[row["vocab"]]
        result = train_and_score(row, steps, data, val, val_chars, work / "runs" / f"{row_name(row)}-{steps}")
        train_tokens = metas[row["vocab"]]["train"]["tokens"]
        result.update(planned_steps=steps, passes=steps * row["batch"] * SEQ_LEN / train_tokens, corpus=args.corpus)
        with results_file.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(format_row(result), flush=True)
        return result

    print(f"{args.corpus}: training tokens by vocabulary: "
          + ", ".join(f"{m['vocab_size']} {m['train']['tokens']:,}" for m in metas.values())
          + "; CPU s per step by (width, vocabulary, batch): "
          + ", ".join(f"{k} {c:.3f}" for k, c in sorted(costs.items())), flush=True)  # fmt: skip
    print(HEADER, flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, rows))
    print("\nall rows:\n" + HEADER)
    for result in results:
        print(format_row(result))
    print(f"work directory: {work}")
    return 0


HEADER = ("row | steps | passes | train loss | best step | val loss best / last | word ppl best / last | "
          "closed-vocabulary word ppl best / last | bits/char best / last | load start / end")  # fmt: skip


def format_row(r: dict) -> str:
    b, last = r["best"], r["latest"]
    return (f"{r['row']} | {r['steps']} | {r['passes']:.1f} | {r['train_loss']:.3f} | {r['best_step']} | "
            f"{b['loss']:.4f} / {last['loss']:.4f} | {b['word_ppl']:.1f} / {last['word_ppl']:.1f} | "
            f"{b.get('closed_word_ppl', float('nan')):.1f} / {last.get('closed_word_ppl', float('nan')):.1f} | "
            f"{b['bits_per_char']:.4f} / {last['bits_per_char']:.4f} | {r['load'][0]} / {r['load'][1]}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
