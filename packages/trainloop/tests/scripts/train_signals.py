"""Train TinyLM with a slow evaluation, for the signal tests; alone or under torchrun. Arguments are JSON overrides.

Every rank prints ``PID <rank> <pid>`` first (the tests signal one rank), ``EVAL <rank> <step>`` when it starts
an evaluation, ``SIGNAL <rank> <name>`` once the trainer's handler has run, and ``SUMMARY <rank> {...}`` at the end.
``eval_sleep_s`` is slept before each evaluation batch. ``after_fit_s``: once ``fit()`` returned, ``FINISHED <rank>``
is printed and that many seconds pass (the finishing work of a real script: adapters, a summary) before the summary.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import BlocksLM, SeqData, TinyLM, eval_batches  # noqa: E402

from trainloop import TrainConfig, Trainer  # noqa: E402
from trainloop.faults import StopSignals  # noqa: E402


def _stop_at_once(self: StopSignals, signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _never_stop_at_once(self: StopSignals, signum: int, frame: object) -> None:
    self.received = signal.Signals(signum).name


# Broken signal handling (``"fault"`` in the arguments), for the tests to show that they catch it.
FAULTS = {"sigint_stops_at_once": _stop_at_once, "second_sigint_ignored": _never_stop_at_once}


def say(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout, and print's separate write of the newline lets
    another rank's line land in between ("EVAL 0 3EVAL 1 3")."""
    os.write(1, (line + "\n").encode())


def main() -> None:
    args = json.loads(sys.argv[1])
    run_dir = args.pop("run_dir")
    eval_sleep_s = args.pop("eval_sleep_s", 0.0)
    n_eval = args.pop("eval_batches_n", 4)
    after_fit_s = args.pop("after_fit_s", 0.0)
    handle = FAULTS[args.pop("fault")] if "fault" in args else StopSignals._handle

    def announced(self: StopSignals, signum: int, frame: object) -> None:
        # Announced after the handler ran, so a test sends a second signal only once the first has been handled
        # (two signals that arrive before Python runs its handler are handled once).
        try:
            handle(self, signum, frame)
        finally:
            say(f"SIGNAL {rank} {signal.Signals(signum).name}")

    StopSignals._handle = announced
    kind = args.pop("model", "tiny")  # "tiny" or "blocks" (what engine="fsdp" shards)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    say(f"PID {rank} {os.getpid()}")
    base = dict(lr=1e-2, min_lr=1e-4, warmup_steps=2, max_steps=10, log_every=1, progress=False, tensorboard=False)
    base.update(args)
    base["micro_batch"] = 8 // world
    cfg = TrainConfig(**base)
    trainer = None

    def slow_eval():
        say(f"EVAL {rank} {trainer.step}")
        for batch in eval_batches(n_eval):
            time.sleep(eval_sleep_s)
            yield batch

    torch.manual_seed(0)
    model = TinyLM() if kind == "tiny" else BlocksLM()
    trainer = Trainer(model, cfg, SeqData(cfg.micro_batch, rank=rank, world_size=world), run_dir=run_dir,
                      eval_data=slow_eval)  # fmt: skip
    out = trainer.fit()
    if after_fit_s:
        say(f"FINISHED {rank}")
        deadline = time.monotonic() + after_fit_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        trainer.close()
    say(f"SUMMARY {rank} " + json.dumps({k: v for k, v in out.items() if k != "eval"} | {"eval": out["eval"]}))


if __name__ == "__main__":
    main()
