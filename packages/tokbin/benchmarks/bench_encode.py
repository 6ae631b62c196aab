"""Encoding throughput: `tokbin encode` (SentencePiece BPE) vs Hugging Face `tokenizers` BPE of the same vocab size.

Corpus: the Python standard library's own .py sources (sysconfig stdlib path, test directories excluded), about
11 MB, concatenated in passes until the corpus reaches --mb megabytes (default 50; --quick 10), written as ~1 MB
files into a temporary directory. Both tokenizers are trained on the same sample of it (first --train-mb MB).

  tokbin        encode_files(...) end to end (read, decode UTF-8, encode, write + checksum the token file),
                with --workers 1 and 2 (worker processes; their CPU time counts in MB/CPU-s); documents are
                the files, EOS after each. Two SentencePiece models:
                "keep-ws" (remove_extra_whitespaces=False, allow_whitespace_only_pieces=True: indentation is
                encoded, as HF does) and "default"
                (SentencePiece's default normalisation, which collapses runs of spaces before encoding)
  hf-tokenizers Tokenizer.encode_batch_fast (encode_batch where absent) on the same lines, already in
                memory, with 1 and 2 rayon threads (each in its own subprocess: the rayon pool size is fixed at
                first use); pre-tokenizers Metaspace (the SentencePiece convention) and ByteLevel (GPT-2),
                timed on the same corpus files as tokbin (--hf-mb times them on the first MB only)

Runs alternate between tokbin and HF (1 thread each, then 2 threads each) so that load from other jobs on a
shared machine falls on both. MB/CPU-s (user + system time of the process) is printed beside wall-clock MB/s
because it is much less sensitive to such load. The last line is the best wall-clock keep-ws tokbin figure
over the best HF figure (any pre-tokenizer, any thread count).
Prints a table and ends with `encode_vs_hf_tokenizers: <ratio>`. Never asserts on time.
Usage: python benchmarks/bench_encode.py [--quick] [--mb 50] [--vocab 8000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3"}


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("test_") for part in parts):
            continue
        out.append(p)
    return out


def build_corpus(dest: Path, megabytes: float) -> list[Path]:
    """~1 MB UTF-8 files made of whole stdlib sources, repeated in passes until ``megabytes`` is reached."""
    target = int(megabytes * 1e6)
    texts = []
    for p in stdlib_sources():
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue  # a handful of stdlib files are latin-1; the corpus stays strictly UTF-8
    files, buf, size, total = [], [], 0, 0
    while total < target:
        for t in texts:
            buf.append(t)
            size += len(t.encode("utf-8"))
            if size >= 1_000_000:
                f = dest / f"corpus_{len(files):04d}.txt"
                f.write_text("".join(buf), encoding="utf-8")
                files.append(f)
                total += size
                buf, size = [], 0
                if total >= target:
                    break
    return files


def hf_worker(args: argparse.Namespace) -> None:
    """Subprocess body: time encode_batch over the corpus lines with the rayon pool size from the environment."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.hf_worker)
    files = [Path(p) for p in args.files]
    lines = []
    nbytes = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        nbytes += len(text.encode("utf-8"))
        lines.extend(text.splitlines(keepends=True))
    batch = 20_000
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips the offsets bookkeeping
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    n_tokens = 0
    for i in range(0, len(lines), batch):
        n_tokens += sum(len(e.ids) for e in encode(lines[i : i + batch], add_special_tokens=False))
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    print(json.dumps({"mb_s": nbytes / dt / 1e6, "mb_cpu_s": nbytes / cpu / 1e6, "tokens": n_tokens}))


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (encode's worker processes), all threads:
    less sensitive to other jobs than wall time."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def train_hf(sample: Path, vocab: int, pre: str, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if pre == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train([str(sample)], trainer)
    path = out / f"hf_{pre}.json"
    tok.save(str(path))
    return path


def run_hf(tok_json: Path, files: list[Path], threads: int) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "RAYON_RS_NUM_CPUS": str(threads)}
    env["TOKENIZERS_PARALLELISM"] = "true"
    cmd = [sys.executable, __file__, "--hf-worker", str(tok_json), "--files", *map(str, files)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 MB corpus (not the 50 MB goal setup)")
    ap.add_argument("--mb", type=float, default=None, help="corpus size in MB (default 50, --quick 10)")
    ap.add_argument("--train-mb", type=float, default=3.0, help="MB of the corpus both tokenizers train on")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--hf-mb", type=float, default=None, help="MB of the corpus HF is timed on (default: all of it)")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--files", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        hf_worker(args)
        return
    from tokbin import encode_files, train_tokenizer

    megabytes = args.mb or (10 if args.quick else 50)
    with tempfile.TemporaryDirectory(prefix="bench_encode_") as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        files = build_corpus(tmp / "corpus", megabytes)
        total = sum(f.stat().st_size for f in files)
        sample = tmp / "sample.txt"
        sample.write_bytes(b"".join(f.read_bytes() for f in files)[: int(args.train_mb * 1e6)].rsplit(b"\n", 1)[0])
        t0 = time.perf_counter()
        models = {
            "keep-ws": train_tokenizer(
                [sample], tmp / "spm_ws", args.vocab, minloglevel=2, remove_extra_whitespaces=False
            ),
            "default": train_tokenizer([sample], tmp / "spm", args.vocab, minloglevel=2),
        }
        spm_train_s = time.perf_counter() - t0
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            hf_paths = {}  # the comparison is optional: tokbin's own figures still print
        else:
            hf_paths = {pre: train_hf(sample, args.vocab, pre, tmp) for pre in ("metaspace", "bytelevel")}

        hf_share = 1.0 if args.hf_mb is None else min(1.0, args.hf_mb * 1e6 / total)
        hf_files = files[: max(1, round(len(files) * hf_share))]
        hf_total = sum(f.stat().st_size for f in hf_files)
        rows = []

        def tokbin_run(name: str, workers: int) -> None:
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            tf = encode_files(models[name], files, tmp / f"{name}{workers}.bin", workers=workers, progress=False)
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
            rows.append((f"tokbin encode {name}", workers, total / dt / 1e6, total / cpu / 1e6, tf.n_tokens, total))

        # Alternate tokbin and HF so that a change in the machine's load falls on both, not on one of them.
        for threads in (1, 2):
            tokbin_run("keep-ws", threads)
            for pre, path in hf_paths.items():
                r = run_hf(path, hf_files, threads)
                rows.append((f"hf-tokenizers BPE {pre}", threads, r["mb_s"], r["mb_cpu_s"], r["tokens"], hf_total))
        for workers in (1, 2):
            tokbin_run("default", workers)
        same = all((tmp / f"{n}1.bin").read_bytes() == (tmp / f"{n}2.bin").read_bytes() for n in models)

    print(f"load average at the end (2 cores, shared): {os.getloadavg()[0]:.1f}")
    print(
        f"corpus: {len(files)} files, {total / 1e6:.1f} MB of stdlib source; vocab {args.vocab}; "
        f"2 SentencePiece models trained in {spm_train_s:.1f} s on {args.train_mb} MB; "
        f"1- and 2-worker files identical: {same}; "
        f"HF timed on {hf_total / 1e6:.1f} MB"
    )
    print(f"{'method':30} {'threads':>7} {'MB/s':>8} {'MB/CPU-s':>9} {'tokens':>12} {'bytes/token':>11}")
    for name, threads, mbs, mb_cpu, ntok, nbytes in rows:
        print(f"{name:30} {threads:7d} {mbs:8.2f} {mb_cpu:9.2f} {ntok:12,d} {nbytes / ntok:11.2f}")
    ours = [r for r in rows if r[0] == "tokbin encode keep-ws"]
    print(f"tokbin_keep_ws_2_workers_vs_1: {ours[1][2] / ours[0][2]:.2f}")
    if not hf_paths:
        print("encode_vs_hf_tokenizers: n/a (Hugging Face tokenizers is not installed)")
        return
    hf = [r for r in rows if r[0].startswith("hf")]
    one_cpu = ours[0][3] / max(r[3] for r in hf if r[1] == 1)
    print(f"encode_vs_hf_tokenizers_per_cpu_second_1_thread: {one_cpu:.2f}")
    print(f"encode_vs_hf_tokenizers: {max(r[2] for r in ours) / max(r[2] for r in hf):.2f}")


if __name__ == "__main__":
    main()
