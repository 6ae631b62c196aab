"""`lmtrain eval --text` against lm-evaluation-harness on the same model and text: which figures agree and why.

    python packages/lmtrain/benchmarks/bench_harness_metrics.py --run RUN_DIR [--text FILE] [--chars 100000]

Needs the `harness` and `hf` extras (prints why and exits 0 without them). The text (default: the run's data
directory's `val.txt`, its first `--chars` characters) becomes a one-document local task of the harness
(`loglikelihood_rolling`, as its `wikitext` task). Scored four ways: `lmtrain eval --text` with its default
overlapping windows (stride = context / 2) and with disjoint windows (stride = context, the harness's);
`lmtrain eval --tasks` (the harness, the model in process); lm-eval's own `hf` model on `lmtrain export --format
hf`, with `add_bos_token` False and its default. Prints each one's bits per byte, word perplexity and word count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TASK = """task: bench_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def lmtrain(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "lmtrain", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lmtrain {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--text", default=None)
    parser.add_argument("--chars", type=int, default=100_000)
    args = parser.parse_args()
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        print(f"bench_harness_metrics: skipped: {exc.name} not installed (pip install 'lmtrain[harness,hf]')")
        return 0
    load_before = os.getloadavg()[0]
    run = Path(args.run)
    run_json = json.loads((run / "run.json").read_text())
    context = int(run_json["data_config"]["seq_len"])
    source = Path(args.text) if args.text else Path(run_json["data"]) / "val.txt"
    text = source.read_text(encoding="utf-8")[: args.chars]
    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    (work / "doc.txt").write_text(text, encoding="utf-8")
    (work / "docs.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    (work / "tasks").mkdir()
    (work / "tasks" / "bench_text.yaml").write_text(TASK.format(data=work / "docs.jsonl"))
    rows = {}
    for name, stride in (
        ("lmtrain eval --text, stride context/2", None),
        ("lmtrain eval --text, stride context", context),
    ):
        flags = [] if stride is None else ["--stride", str(stride)]
        r = json.loads(
            lmtrain("eval", "--run", str(run), "--text", str(work / "doc.txt"), "--json", *flags).splitlines()[-1]
        )
        rows[name] = (r["bits_per_byte"], r["word_ppl"], r["words"])
    lmtrain("eval", "--run", str(run), "--tasks", "bench_text", "--include-path", str(work / "tasks"),
            "--bootstrap-iters", "0", "--out", str(work / "results"))  # fmt: skip
    r = json.loads((work / "results" / "results.json").read_text())["results"]["bench_text"]
    words = len(re.split(r"\s+", text))
    rows["lmtrain eval --tasks (harness)"] = (r["bits_per_byte,none"], r["word_perplexity,none"], words)
    lmtrain("export", "--run", str(run), "--out", str(work / "hf"), "--format", "hf")
    manager = TaskManager(include_path=str(work / "tasks"))
    for add_bos in (False, None):
        lm = HFLM(pretrained=str(work / "hf"), device="cpu", batch_size=8, add_bos_token=add_bos)
        r = lm_eval.simple_evaluate(model=lm, tasks=["bench_text"], task_manager=manager, bootstrap_iters=0,
                                    log_samples=False)["results"]["bench_text"]  # fmt: skip
        label = "add_bos_token=False" if add_bos is False else "default add_bos_token"
        rows[f"lm-eval hf model on the export, {label}"] = (r["bits_per_byte,none"], r["word_perplexity,none"], words)
    base = rows["lmtrain eval --text, stride context"][0]
    print(f"{len(text):,} characters of {source}, context {context}")
    print(f"{'scored by':58} {'bits/byte':>10} {'/ disjoint':>10} {'word ppl':>10} {'words':>8}")
    for name, (bpb, wppl, n) in rows.items():
        print(f"{name:58} {bpb:10.6f} {bpb / base:10.6f} {wppl:10.3f} {n:8,}")
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
