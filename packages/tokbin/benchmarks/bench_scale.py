"""Memory and throughput of `tokbin encode` and `lmtrain prepare` as the input grows.

Corpus: the Python standard library's own .py sources (test directories excluded), repeated in passes with a
variation per pass (a header line, `self` renamed) until --gb gigabytes, written twice under a temporary directory
(deleted at the end): as plain text files of about 64 MB (a document per file, so documents are far longer than a
piece) and as JSONL files of about 64 MB (a source file per line). Free disk is checked first (`df`'s figure).

Each command runs as a subprocess; its peak memory is the largest sum of RSS over its process tree (the encode
process and its workers, sampled every 0.1 s with psutil; pages the forked workers share with their parent count
once per process, so this overstates), and beside it the largest single process from getrusage(RUSAGE_CHILDREN).

Prints:
  encode_peak_rss_mb at 1 GB and at --gb of text (all workers, one run: the first figure is the peak while the
  first half of the token output was written), encode_rss_growth_1gb_to_2gb (goal <= 1.1, peak goal < 1 GB),
  encode_mb_per_s with 1 worker and with all workers on the first --throughput-mb of text and their ratio
  (goal >= 1.7 on an idle 2-core machine; the load average is printed beside; each the fastest of --repeats runs),
  machine_parallel_capacity (the same number of independent 1-worker encodes side by side: how much faster the
  machine does N times the work than once; N on N idle, unshared cores) and encode_workers_efficiency (the
  speedup over that capacity: what the worker pool loses to its own coordination), and prepare_peak_rss_mb of
  `lmtrain prepare` on the JSONL corpus (when lmtrain is installed).
Never asserts on time.
Usage: python benchmarks/bench_scale.py [--gb 2] [--throughput-mb 200] [--workers N] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3"}
PART_BYTES = 64 << 20


def stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*.py")):
        if any(part in SKIP_DIRS or part.startswith("test_") for part in p.relative_to(root).parts):
            continue
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def build_corpus(dest: Path, n_bytes: int) -> tuple[list[Path], list[Path]]:
    """Text and JSONL parts of about PART_BYTES each, both holding the same documents, until n_bytes of text."""
    (dest / "text").mkdir(parents=True)
    (dest / "jsonl").mkdir()
    texts = stdlib_texts()
    text_parts, jsonl_parts, written, n = [], [], 0, 0
    while written < n_bytes:
        k = len(text_parts)
        tpath, jpath = dest / "text" / f"part_{k:04d}.txt", dest / "jsonl" / f"part_{k:04d}.jsonl"
        size = 0
        with open(tpath, "w", encoding="utf-8") as t, open(jpath, "w", encoding="utf-8") as j:
            while size < PART_BYTES and written + size < n_bytes:
                doc = f"# pass {n // len(texts)} variant\n" + texts[n % len(texts)].replace("self", f"self_{n % 97}")
                t.write(doc)
                j.write(json.dumps({"id": n, "text": doc}) + "\n")
                size += len(doc.encode("utf-8"))
                n += 1
        text_parts.append(tpath)
        jsonl_parts.append(jpath)
        written += size
    return text_parts, jsonl_parts


def measured(cmd: list[str], progress_glob: Path | None = None) -> dict:
    """Run ``cmd``; wall seconds, peak RSS summed over its process tree (MB), largest single process (MB).

    With ``progress_glob`` (a directory), also the peak over the first half of the output written (the temp files
    growing there): the peak while the first half of the input was encoded.
    """
    import psutil

    samples = []  # (tree RSS, bytes of output written so far)

    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = 0
                for p in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        rss += p.memory_info().rss
                peak = max(peak, rss)
                if progress_glob is not None:
                    written = 0
                    for f in progress_glob.glob(".*.tmp"):
                        with contextlib.suppress(FileNotFoundError):
                            written += f.stat().st_size
                    samples.append((rss, written))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
        out = proc.stdout.read()
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{err.read()[-2000:]}")
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KB on Linux; a running max
    result = {"s": wall, "tree_mb": peak / 2**20, "single_mb": single, "out": out.strip()}
    if samples:
        final = max(w for _, w in samples)
        result["first_half_tree_mb"] = max((r for r, w in samples if w <= final / 2), default=0) / 2**20
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="corpus size in GB of text (default 2)")
    ap.add_argument("--throughput-mb", type=float, default=200.0, help="text timed with 1 and all workers")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="'all workers' (default: CPUs)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each throughput row; the fastest counts")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--prepare-sample-mb", type=float, default=50.0, help="lmtrain prepare --tokenizer-sample-mb")
    ap.add_argument("--tmp", default=None, help="where the corpus goes (default: the system temp directory)")
    args = ap.parse_args()
    from tokbin import train_tokenizer

    base = Path(args.tmp or tempfile.gettempdir())
    need = int(args.gb * 1e9 * 3.2) + (2 << 30)  # text + JSONL + token files + prepare's outputs, with room
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, this run needs about {need / 1e9:.1f} GB (see --gb)")
    work = Path(tempfile.mkdtemp(prefix="bench_scale_", dir=base))
    py = sys.executable
    try:
        t0 = time.perf_counter()
        text_parts, jsonl_parts = build_corpus(work, int(args.gb * 1e9))
        sizes = [p.stat().st_size for p in text_parts]
        total = sum(sizes)
        print(f"corpus: {total / 1e9:.2f} GB of text in {len(text_parts)} files, the same documents as JSONL "
              f"({sum(p.stat().st_size for p in jsonl_parts) / 1e9:.2f} GB), built in {time.perf_counter() - t0:.0f} s"
              f" under {work}", flush=True)  # fmt: skip
        sample = work / "sample.txt"
        sample.write_bytes(text_parts[0].read_bytes()[: 10 << 20])
        model = train_tokenizer(
            [sample], work / "spm", args.vocab, byte_fallback=True, normalization_rule_name="identity",
            add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"], minloglevel=2,
        )  # fmt: skip

        def encode_cmd(parts: list[Path], workers: int, out: str) -> list[str]:
            return [py, "-m", "tokbin.cli", "encode", "--tokenizer", str(model), "--input", *map(str, parts),
                    "--output", str(work / out), "--workers", str(workers), "--quiet"]  # fmt: skip

        def encode(parts: list[Path], workers: int, out: str, progress: bool = False) -> dict:
            r = measured(encode_cmd(parts, workers, out), work if progress else None)
            (work / out).unlink()
            return r

        def side_by_side(parts: list[Path], copies: int) -> float:
            """Wall seconds of `copies` independent 1-worker encodes of ``parts`` started together."""
            t0 = time.perf_counter()
            procs = [subprocess.Popen(encode_cmd(parts, 1, f"copy{i}.bin"), stdout=subprocess.DEVNULL)
                     for i in range(copies)]  # fmt: skip
            if any(p.wait() for p in procs):
                raise SystemExit("an independent 1-worker encode failed")
            for i in range(copies):
                (work / f"copy{i}.bin").unlink()
            return time.perf_counter() - t0

        def first(n_bytes: float) -> list[Path]:
            acc, out = 0, []
            for p, s in zip(text_parts, sizes, strict=True):
                if acc >= n_bytes:
                    break
                out.append(p)
                acc += s
            return out

        small = first(args.throughput_mb * 1e6)
        small_bytes = sum(p.stat().st_size for p in small)
        rows = []
        r2 = encode(text_parts, args.workers, "all.bin", progress=True)
        rows.append(("encode text, all workers", total, args.workers, r2))
        one = min((encode(small, 1, "one.bin") for _ in range(args.repeats)), key=lambda r: r["s"])
        rows.append(("encode text, 1 worker", small_bytes, 1, one))
        every = min((encode(small, args.workers, "every.bin") for _ in range(args.repeats)), key=lambda r: r["s"])
        rows.append(("encode text, all workers", small_bytes, args.workers, every))
        apart = min(side_by_side(small, args.workers) for _ in range(args.repeats))
        prep = None
        try:
            import lmtrain  # noqa: F401
        except ImportError:
            pass
        else:
            cmd = [py, "-m", "lmtrain", "prepare", "--text", str(work / "jsonl"), "--jsonl-field", "text", "--out",
                   str(work / "data"), "--vocab-size", str(args.vocab), "--val-fraction", "0.01",
                   "--tokenizer-sample-mb", str(args.prepare_sample_mb), "--workers", str(args.workers),
                   "--quiet"]  # fmt: skip
            prep = measured(cmd)
            rows.append(("lmtrain prepare, JSONL", sum(p.stat().st_size for p in jsonl_parts), args.workers, prep))
        load = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs "
          "(a shared machine is not idle: the worker ratio is a lower bound there)")  # fmt: skip
    print(f"{'run':28} {'input MB':>9} {'workers':>7} {'s':>8} {'MB/s':>7} {'tree RSS MB':>11} {'1 proc MB':>9}")
    for name, n_bytes, workers, r in rows:
        print(f"{name:28} {n_bytes / 1e6:9.0f} {workers:7d} {r['s']:8.1f} {n_bytes / 1e6 / r['s']:7.2f} "
              f"{r['tree_mb']:11.0f} {r['single_mb']:9.0f}")  # fmt: skip
    print(f"encode_peak_rss_mb_1gb: {r2['first_half_tree_mb']:.0f}  (peak over the first half of the input)")
    print(f"encode_peak_rss_mb_2gb: {r2['tree_mb']:.0f}")
    print(f"encode_rss_growth_1gb_to_2gb: {r2['tree_mb'] / r2['first_half_tree_mb']:.3f}")
    print(f"encode_mb_per_s_1_worker: {small_bytes / 1e6 / one['s']:.2f}")
    print(f"encode_mb_per_s_{args.workers}_workers: {small_bytes / 1e6 / every['s']:.2f}")
    print(f"encode_workers_speedup: {one['s'] / every['s']:.2f}")
    capacity = args.workers * one["s"] / apart
    print(
        f"machine_parallel_capacity: {capacity:.2f}  ({args.workers} independent 1-worker encodes side by side: "
        f"{apart:.1f} s for {args.workers}x the work of {one['s']:.1f} s; {args.workers}.00 on idle, unshared cores)"
    )
    print(f"encode_workers_efficiency: {one['s'] / every['s'] / capacity:.2f}  (speedup / capacity)")
    if prep is not None:
        print(f"prepare_peak_rss_mb: {prep['tree_mb']:.0f}")


if __name__ == "__main__":
    main()
