"""Under torchrun: train TinyLM a few steps for each case (ZeRO stage, precision, DeepSpeed config) in one launch;
rank 0 prints the losses, norms and where each run lives."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import SeqData, TinyLM  # noqa: E402

from trainloop import TrainConfig, Trainer  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    results = {}
    for case in args["cases"]:
        name = case.get("name", f"{case['stage']}_{case['precision']}")
        clip = case.get("clip_groups", {"embed.*": 0.3, "*o_proj*": 0.05})
        accum = case.get("grad_accum", 1)
        micro = case.get("global_batch", 8) // world // accum
        lr, min_lr = case.get("lr", 1e-2), case.get("min_lr", 1e-4)
        cfg = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=2, max_steps=args["steps"], micro_batch=micro,
                          grad_accum=accum, log_every=1, progress=False, tensorboard=False, engine="deepspeed",
                          precision=case["precision"], clip_groups=clip, save_every=args["steps"],
                          inspect_steps=case.get("inspect_steps", []))  # fmt: skip
        torch.manual_seed(0)
        run_dir = Path(args["run_dir"]) / name
        ds = case.get("ds_config", {"zero_optimization": {"stage": case["stage"]}})
        model = TinyLM(d=case.get("width", 16), tied=case.get("tied", False))
        trainer = Trainer(model, cfg, SeqData(micro, rank=rank, world_size=world), run_dir=run_dir, ds_config=ds)
        trainer.fit()
        if rank == 0:
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            results[name] = {
                "loss": [r["loss"] for r in recs if "loss" in r],
                "norms": [r["grad_norm"] for r in recs if "loss" in r],
                "run_dir": str(run_dir),
                "notes": trainer.engine.notes,
                # What DeepSpeed's ZeRO-3 optimizer says it does (absent under stages 0-2).
                "zero3": {
                    k: getattr(trainer.engine.optimizer, k, None)
                    for k in ("offload_param", "offload_optimizer", "swap_optimizer")
                },
            }
    if rank == 0:
        os.write(1, ("RESULTS " + json.dumps(results) + "\n").encode())  # one write: ranks share stdout


if __name__ == "__main__":
    main()
