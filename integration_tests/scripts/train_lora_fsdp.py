"""LoRA adapters on an lmcore GPT trained by trainloop's FSDP engine under torchrun: only the adapters may change.

Prints ``LORA {...}`` on rank 0: what changed between the initial model and the final checkpoint's consolidated
weights, and how many tensors the optimizer steps. The argument is the run directory.
"""

import json
import os
import sys

import torch

from lmcore import GPT, ModelConfig
from lmcore.lora import apply_lora
from trainloop import TrainConfig, Trainer, load_model_weights


def batches(vocab: int, rows: int, seq: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        start = torch.randint(0, vocab, (rows, 1), generator=g)
        ids = (start + torch.arange(seq + 1)) % vocab  # (rows, seq + 1): a rule the adapters can learn
        yield ids[:, :-1], ids[:, 1:]


def main() -> None:
    run_dir = sys.argv[1]
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    model = apply_lora(GPT(ModelConfig.from_preset("tiny")), targets=["q", "v"], r=4, alpha=8.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    cfg = TrainConfig(engine="fsdp", lr=1e-2, max_steps=6, micro_batch=4, log_every=1, progress=False, weight_decay=0.0)
    trainer = Trainer(model, cfg, batches(97, 4, 16, rank), run_dir=run_dir)
    out = trainer.fit()
    stepped = sum(len(g["params"]) for g in trainer.engine.optimizer.param_groups)
    from torch.distributed.tensor import DTensor

    frozen_sharded = all(isinstance(p, DTensor) for n, p in model.named_parameters() if not p.requires_grad)
    if rank == 0:
        after = load_model_weights(out["checkpoint"])
        changed = sorted(k for k in after if k in before and not torch.equal(after[k], before[k]))
        reloaded = GPT.from_pretrained(out["checkpoint"])  # the adapters applied again from the file's settings
        report = {"changed": changed, "trainable": trainable, "stepped": stepped, "frozen_sharded": frozen_sharded,
                  "reloaded_adapters": sum(".lora_" in n for n, _ in reloaded.named_parameters())}  # fmt: skip
        os.write(1, ("LORA " + json.dumps(report) + "\n").encode())  # one write: ranks share stdout


if __name__ == "__main__":
    main()
