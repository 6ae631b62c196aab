"""llama.cpp on the GGUF export: its logits, tokens and perplexity against the toolkit's on the same text.

    python packages/lmtrain/benchmarks/bench_gguf.py [--run RUN_DIR] [--time-budget 120] [--llama-cpp DIR]

Needs `llama-cpp-python` (llama.cpp's Python binding; it builds llama.cpp from source at install) and the `gguf`
and `hf` extras; prints why and exits 0 without them. Without `--run` it trains one: `lmtrain prepare` on 2 MB of
this Python's standard-library source (the held-out tenth by document hash), `cpu-small --set bias=false` for
`--time-budget` seconds (bias-free so that the MPT export exists for llama.cpp's own converter as well).

Then: `lmtrain export --format gguf` in f32 and f16, and llama.cpp (through llama-cpp-python, one thread) and the
toolkit's model (fp32, torch) score the same token windows of the held-out text (`val.txt`). Printed:
- tokens: llama.cpp's tokenizer on the GGUF vocabulary against the toolkit's ids (document-start token in front);
- logits: the largest |difference| over every position and vocabulary entry, the largest |logit|, the share of
  positions whose argmax agrees;
- token perplexity over the windows, each.

With `--llama-cpp DIR` (a llama.cpp checkout, e.g. the one vendored in llama-cpp-python's sdist), its own
`convert_hf_to_gguf.py` converts the `--format hf` export unchanged (its vendored gguf-py on PYTHONPATH); printed:
whether it ran, whether its tensors equal ours, the tokenizer keys where its file differs from ours, and whether
llama.cpp tokenizes text on the converted file as on ours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def trained_run(work: Path, budget: float) -> Path:
    from lmtrain.corpus import build_corpus
    from lmtrain.prepare_data import prepare
    from lmtrain.train_run import train

    corpus = work / "corpus.txt"
    build_corpus(corpus, 2_000_000)
    prepare([corpus], work / "data", val_fraction=0.1, progress=False)
    run = work / "run"
    train(work / "data", run, recipe="cpu-small", time_budget_s=budget, quiet=True, overrides={"bias": False})
    return run


def windows_of(ids: list[int], size: int, count: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, min(len(ids), size * count) - size + 1, size)]


def llama_logits(llm, window: list[int]):
    import numpy as np

    llm.reset()
    llm.eval(window)
    return torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32))  # (T, V)


def nll_sum(logits: torch.Tensor, window: list[int]) -> float:
    """Summed NLL of window[1:] given what precedes, from (T, V) logits."""
    targets = torch.tensor(window[1:])
    return float(torch.nn.functional.cross_entropy(logits[:-1].double(), targets, reduction="sum"))


def converter_check(llama_cpp: Path, hf_dir: Path, ours: Path, work: Path) -> dict:
    import gguf

    out = work / "converted-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    done = subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
         "--outtype", "f32"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        return {"converter": f"failed: {done.stderr.strip().splitlines()[-1]}"}
    theirs, mine = gguf.GGUFReader(out), gguf.GGUFReader(ours)
    t_theirs = {t.name: t for t in theirs.tensors}
    t_mine = {t.name: t for t in mine.tensors}
    same = set(t_theirs) == set(t_mine) and all(
        bool((t_theirs[n].data == t_mine[n].data).all()) for n in t_mine
    )  # fmt: skip
    keys = {}
    for key in sorted(set(theirs.fields) | set(mine.fields)):
        if not key.startswith(("tokenizer.ggml.", "mpt.")) or key.endswith(("tokens", "scores", "token_type")):
            continue
        a = theirs.fields[key].contents() if key in theirs.fields else None
        b = mine.fields[key].contents() if key in mine.fields else None
        if a != b:
            keys[key] = {"converter": a, "lmtrain": b}
    return {"converter": "ran unchanged", "tensors_equal": same, "keys_that_differ": keys, "file": str(out)}


def tokens_of(path: Path, text: str) -> list[int]:
    """llama.cpp's tokens of `text` with the file's own settings (BOS added when the file says so)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    return llm.tokenize(text.encode("utf-8"), add_bos=bool(llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"),
                        special=False)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="a run directory (bias-free for the converter check)")
    parser.add_argument("--time-budget", type=float, default=120.0, help="training seconds when --run is not given")
    parser.add_argument("--text", default=None, help="text to score (default: the run's data directory's val.txt)")
    parser.add_argument("--windows", type=int, default=8, help="windows of the text to score")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR", help="llama.cpp checkout for its converter")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    missing = [m for m in ("llama_cpp", "gguf", "transformers") if not have(m)]
    if missing:
        print(
            f"bench_gguf: skipped: {', '.join(missing)} not installed (pip install llama-cpp-python 'lmtrain[gguf,hf]')"
        )
        return 0
    from llama_cpp import Llama

    from lmtrain.export import export_run
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.text_codec import encode

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    run = Path(args.run) if args.run else trained_run(work, args.time_budget)
    model, run_json, checkpoint = load_trained_model(run)
    sp = load_tokenizer(run)
    eos = run_json.eos_id
    context = run_json.seq_len
    val = Path(args.text) if args.text else Path(run_json.data) / "val.txt"  # prepare's held-out text
    text = val.read_text(encoding="utf-8")[:200_000]
    ids = [eos] + encode(sp, text)
    windows = windows_of(ids, 2 * context, args.windows)  # twice the training context: ALiBi past it

    files = {}
    for outtype in ("f32", "f16"):
        files[outtype] = work / f"model-{outtype}.gguf"
        if not files[outtype].exists():
            export_run(run, files[outtype], fmt="gguf", checkpoint=str(checkpoint), gguf_type=outtype)

    results: dict = {"checkpoint": str(checkpoint), "windows": len(windows), "window_tokens": 2 * context}
    with torch.no_grad():
        ours = [model(torch.tensor([w])).logits[0].float() for w in windows]
    ours_nll = sum(nll_sum(lg, w) for lg, w in zip(ours, windows, strict=True))
    scored = sum(len(w) - 1 for w in windows)
    results["torch_token_ppl"] = math.exp(ours_nll / scored)
    for outtype, path in files.items():
        llm = Llama(model_path=str(path), n_ctx=2 * context, n_batch=2 * context, n_ubatch=2 * context,
                    logits_all=True, n_threads=1, verbose=False)  # fmt: skip
        sample = text[:2000]
        theirs_ids = tokens_of(path, sample)
        theirs = [llama_logits(llm, w) for w in windows]
        diff = max(float((a - b).abs().max()) for a, b in zip(theirs, ours, strict=True))
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(theirs, ours, strict=True))
        nll = sum(nll_sum(lg, w) for lg, w in zip(theirs, windows, strict=True))
        results[outtype] = {
            "tokens_equal": theirs_ids == [eos] + encode(sp, sample),
            "max_abs_logit_diff": diff,
            "max_abs_logit": max(float(b.abs().max()) for b in ours),
            "argmax_agree": agree / sum(len(w) for w in windows),
            "token_ppl": math.exp(nll / scored),
        }
        del llm
    if args.llama_cpp:
        hf_dir = work / "hf"
        if not hf_dir.exists():
            export_run(run, hf_dir, fmt="hf", checkpoint=str(checkpoint))
        check = converter_check(Path(args.llama_cpp), hf_dir, files["f32"], work)
        if "file" in check:
            sample = text[:2000]
            converted = tokens_of(Path(check["file"]), sample)
            check["converted_tokens_equal"] = converted == [eos] + encode(sp, sample)
            check["converted_first_tokens"] = converted[:6]
            check["lmtrain_first_tokens"] = ([eos] + encode(sp, sample))[:6]
        results["llama_cpp_converter"] = check
    results["load_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
