"""One optimizer step of BlocksLM over micro-batches of uneven target counts; prints GRADS {name: gradient} (the full
gradient the step clips, as the inspect hook sees it) on rank 0. Launched directly or under torchrun; the argument
is JSON: {"run_dir": ..., "engine": "torch" | "fsdp" | "deepspeed", "batches": [[inputs, targets], ...] per rank}."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import BlocksLM  # noqa: E402

import trainloop.gradient_inspector as inspector  # noqa: E402
from trainloop import TrainConfig, Trainer  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    rank = int(os.environ.get("RANK", 0))
    mine = [(torch.tensor(x), torch.tensor(y)) for x, y in args["batches"][rank]]
    seen = {}

    def capture(named_grads, out_dir, step, groups, *, write=True):
        seen.update({name: g.tolist() for name, g in named_grads})

    inspector.inspect_gradients = capture
    torch.manual_seed(0)
    model = BlocksLM()
    cfg = TrainConfig(max_steps=1, grad_accum=len(mine), micro_batch=mine[0][0].shape[0], lr=1e-3, clip=0.0,
                      log_every=1, progress=False, inspect_steps=[1], engine=args.get("engine", "torch"))  # fmt: skip
    ds = {"train_micro_batch_size_per_gpu": cfg.micro_batch, "zero_optimization": {"stage": 2}}
    Trainer(model, cfg, mine, run_dir=args["run_dir"], ds_config=ds if cfg.engine == "deepspeed" else None).fit()
    if rank == 0:
        print("GRADS " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
