"""Under torchrun: TinyLM on ZeRO-2 with offload_optimizer, the DeepSpeed JSON adopted into the TrainConfig first (as
an application does); rank 0 prints the optimizer the engine steps, the engine's line and the losses."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import SeqData, TinyLM  # noqa: E402

from trainloop import TrainConfig, Trainer, adopt_ds_config  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    run = TrainConfig(min_lr=1e-4, warmup_steps=2, max_steps=args["steps"], log_every=1, progress=False,
                      tensorboard=False, engine="deepspeed", precision="bf16", save_every=args["save_every"],
                      clip_groups={"embed.*": 0.3, "*o_proj*": 0.05})  # fmt: skip
    cfg = adopt_ds_config(args["ds_config"], run, world, on_cpu=True).config
    torch.manual_seed(0)
    data = SeqData(cfg.micro_batch, rank=rank, world_size=world)
    trainer = Trainer(TinyLM(), cfg, data, run_dir=args["run_dir"], ds_config=args["ds_config"])
    trainer.fit(resume=args.get("resume", False))
    if rank == 0:
        base = trainer.engine.optimizer.optimizer  # the ZeRO wrapper's own optimizer: what steps on the host
        recs = [json.loads(x) for x in (Path(args["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        out = {
            "optimizer": f"{type(base).__module__}.{type(base).__qualname__}",
            "fused": [g.get("fused") for g in base.param_groups],
            "state_devices": sorted(
                {t.device.type for s in base.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
            ),  # fmt: skip
            "micro_batch": cfg.micro_batch,
            "notes": trainer.engine.notes,
            "steps": [r["step"] for r in recs if "loss" in r],
            "loss": [r["loss"] for r in recs if "loss" in r],
        }
        os.write(1, ("RESULT " + json.dumps(out) + "\n").encode())  # one write: ranks share stdout


if __name__ == "__main__":
    main()
