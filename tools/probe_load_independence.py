"""Do a run's numbers depend on the machine's load? Identical `lmtrain train` commands, and runs killed (SIGKILL) at a
random step and resumed, for pretraining and a LoRA fine-tune, all beside busy processes that load every core;
each run's per-step losses compared bit for bit with the first uninterrupted run of its kind. Prints counts; asserts
nothing.

    python tools/probe_load_independence.py [--busy 6] [--runs 3] [--kills 5] [--steps 60] [--out DIR]

The runs share one fresh probe cache (LMTRAIN_PROBE_CACHE), as the runs of one machine do: the first run probes
its threads and GEMM library under the load, the others take its answers, and a resumed run takes its own record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD_ENV = {"TQDM_DISABLE": "1", "PYTHONHASHSEED": "0"}


def lmtrain(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmtrain", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def finished(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {err[-2000:]}")


def losses(run: Path) -> dict[int, float]:
    """step -> training loss; a resumed run's later records win."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def last_step(run: Path) -> int:
    try:
        return max(losses(run), default=0)
    except (OSError, json.JSONDecodeError, ValueError):
        return 0


def killed_and_resumed(argv: list[str], run: Path, steps: int, env: dict[str, str], rng: random.Random) -> int:
    """Start ``argv`` into ``run``, SIGKILL it once it has logged a random step past the first checkpoint, resume it
    to the end; returns the step it was killed after."""
    at = rng.randint(12, steps - 5)
    proc = lmtrain(*argv, env=env)
    while last_step(run) < at and proc.poll() is None:
        time.sleep(0.05)
    killed = last_step(run)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished(lmtrain(*argv, "--resume", env=env), f"resume of {run}")
    return killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, default=6, help="busy processes beside the runs")
    p.add_argument("--runs", type=int, default=3, help="identical fresh runs of each kind")
    p.add_argument("--kills", type=int, default=5, help="killed and resumed runs of each kind")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="probe-load")
    p.add_argument("--seed", type=int, default=0, help="where the kills fall")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from lmtrain.examples import tiny_data
    from lmtrain.instructions import write_instructions

    data = tiny_data(out)
    pairs = out / "pairs.jsonl"
    write_instructions(pairs, 200, 400)
    env = {**os.environ, **CHILD_ENV, "LMTRAIN_PROBE_CACHE": str(out / "probes.json")}
    env.pop("OMP_NUM_THREADS", None)  # the thread probe runs
    steady = ["--max-steps", str(args.steps), "--set", "log_every=1", "--set", "eval_every=0", "--set",
              "save_every=5", "--no-progress"]  # fmt: skip
    kinds = {
        "train": lambda run: ["train", "--data", str(data), "--out", str(run), "--preset", "tiny", *steady],
        "finetune": lambda run: ["finetune", "--from", str(out / "train-0"), "--data", str(pairs), "--out", str(run),
                                 "--method", "lora", "--seq-len", "128", *steady, "--set", "micro_batch=4"],
    }  # fmt: skip
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    try:
        load_start = os.getloadavg()
        for kind, argv in kinds.items():
            runs = [out / f"{kind}-{i}" for i in range(args.runs)]
            for run in runs:
                finished(lmtrain(*argv(run), env=env), str(run))
            reference = losses(runs[0])
            records = [json.loads((run / "run.json").read_text()) for run in runs]
            same = sum(losses(run) == reference for run in runs[1:])
            choices = sorted({(r.get("cpu_threads"), r.get("cpu_matmul")) for r in records})
            print(f"{kind}: identical fresh runs bit-identical to the first: {same}/{len(runs) - 1} "
                  f"(threads, GEMM library chosen: {choices})", flush=True)  # fmt: skip
            exact, kills = 0, []
            for i in range(args.kills):
                run = out / f"{kind}-killed-{i}"
                kills.append(killed_and_resumed(argv(run), run, args.steps, env, rng))
                got = losses(run)
                exact += got == reference
                if got != reference:
                    far = max(abs(got[s] - reference[s]) for s in reference if s in got)
                    print(f"  {run.name}: killed after step {kills[-1]}, differs by up to {far:.3g}", flush=True)
            print(f"{kind}: killed (after steps {kills}) and resumed runs bit-identical to the uninterrupted one: "
                  f"{exact}/{args.kills}", flush=True)  # fmt: skip
        load_end = os.getloadavg()
    finally:
        for proc in busy:
            proc.kill()
    print(f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; {args.busy} busy processes; "
          f"{time.perf_counter() - t0:.0f} s; CPU {cpu_model()}")  # fmt: skip


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
