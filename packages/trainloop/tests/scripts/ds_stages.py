"""Under torchrun: train TinyLM for a few steps at each requested ZeRO stage/precision; rank 0 prints the losses."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import SeqData, TinyLM  # noqa: E402

from trainloop import TrainConfig, Trainer, latest_checkpoint, load_model_weights  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    results = {}
    for case in args["cases"]:
        stage, precision = case["stage"], case["precision"]
        clip = case.get("clip_groups", {"embed.*": 0.3, "*o_proj*": 0.05})
        cfg = TrainConfig(lr=1e-2, min_lr=1e-4, warmup_steps=2, max_steps=args["steps"], micro_batch=8 // world,
                          log_every=1, progress=False, tensorboard=False, engine="deepspeed", precision=precision,
                          clip_groups=clip, save_every=args["steps"])  # fmt: skip
        torch.manual_seed(0)
        run_dir = Path(args["run_dir"]) / f"s{stage}_{precision}"
        ds = {"zero_optimization": {"stage": stage}}
        trainer = Trainer(TinyLM(), cfg, SeqData(cfg.micro_batch, rank=rank, world_size=world), run_dir=run_dir,
                          ds_config=ds)  # fmt: skip
        trainer.fit()
        if rank == 0:
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            w = load_model_weights(latest_checkpoint(run_dir))
            results[f"{stage}_{precision}"] = {
                "loss": [r["loss"] for r in recs if "loss" in r],
                "norms": [r["grad_norm"] for r in recs if "loss" in r],
                "head_sum": float(w["head.weight"].double().sum()),
            }
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
