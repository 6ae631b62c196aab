"""After a micro-batch that does not step, which gradients does the FSDP engine hold? Prints ``SYNC {...}``: the
number of parameters with a (sharded) .grad, without and with fsdp_sync_every_micro. Launched with torchrun."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import BlocksLM, SeqData  # noqa: E402

from trainloop import TrainConfig, make_engine  # noqa: E402


def main() -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = {}
    for every in (False, True):
        torch.manual_seed(0)
        engine = make_engine(BlocksLM(), TrainConfig(engine="fsdp", grad_accum=2, fsdp_sync_every_micro=every))
        inputs, targets = next(SeqData(4, rank=rank, world_size=world))
        engine.backward(inputs, targets, sync=False, divisor=2.0)
        out[str(every)] = sum(p.grad is not None for p in engine.module.parameters())
    if rank == 0:
        out["params"] = sum(1 for _ in BlocksLM().parameters())
        os.write(1, ("SYNC " + json.dumps(out) + "\n").encode())  # one write: ranks share stdout


if __name__ == "__main__":
    main()
