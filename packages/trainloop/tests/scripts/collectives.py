"""Under torchrun: trainloop's collectives and its teardown, each rank printing what it saw as a JSON line.

``{"mode": "close"}`` closes the Trainer; ``{"mode": "exit"}`` leaves the process group to the atexit teardown, which
a later-registered atexit handler (run first) and an earlier one (run after it) observe. Each rank writes its
observations to RUN_DIR/reports_<rank>.jsonl.
"""

import atexit
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import SeqData, TinyLM  # noqa: E402

from trainloop import TrainConfig, Trainer  # noqa: E402
from trainloop import distributed as td  # noqa: E402

REPORTS: Path | None = None


def report(**values) -> None:
    # One file per rank: at exit the two ranks' prints would interleave on torchrun's shared stdout.
    with open(REPORTS / f"reports_{os.environ['RANK']}.jsonl", "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), **values}) + "\n")


def main() -> None:
    global REPORTS
    args = json.loads(sys.argv[1])
    REPORTS = Path(args["run_dir"])
    atexit.register(lambda: report(when="after teardown", initialised=dist.is_initialized()))
    world = int(os.environ["WORLD_SIZE"])
    # Every tensor trainloop hands to a collective must be one of its buffers; nothing may go through a pickle.
    passed, pickled = [], []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *a, **kw):
        passed.append(tensor)
        return real_all_reduce(tensor, *a, **kw)

    dist.all_reduce = recording_all_reduce
    for name in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **kw: (pickled.append(_name), _real(*a, **kw))[1])
    cfg = TrainConfig(max_steps=2, micro_batch=8 // world, log_every=1, progress=False, tensorboard=False)
    trainer = Trainer(TinyLM(), cfg, SeqData(cfg.micro_batch, rank=dist.get_rank() if dist.is_initialized() else 0,
                                              world_size=world), run_dir=args["run_dir"])  # fmt: skip
    trainer.fit()
    rank = dist.get_rank()
    summed = td.all_reduce_sum(torch.tensor([float(rank + 1), 10.0 * rank]))
    document = {"rank0": "x" * (3 * td._CHUNK + 17), "nested": [1, None, "é"]} if rank == 0 else None
    received = td.broadcast_json(document)
    report(
        summed=summed.tolist(),
        received_ok=received == {"rank0": "x" * (3 * td._CHUNK + 17), "nested": [1, None, "é"]},
        buffers=len(td._BUFFERS),
        collectives=len(passed),
        not_buffers=sum(all(t is not b for b in td._BUFFERS.values()) for t in passed),
        pickled=pickled,
    )
    if args["mode"] == "close":
        trainer.close()
        report(when="after close", initialised=dist.is_initialized(),
               buffers_held_elsewhere=sum(b._use_count() > 1 for b in td._BUFFERS.values()))  # fmt: skip
        trainer.close()  # a second close is a no-op
    else:
        atexit.register(lambda: report(when="before teardown", initialised=dist.is_initialized()))


if __name__ == "__main__":
    main()
