"""QLoRA (lmcore.qlora: NF4 base weights, LoRA adapters) trained by trainloop, on one process (engine "torch") or
under torchrun with the FSDP engine. The argument is a JSON object: ``run_dir``, ``engine``, ``max_steps``,
``save_every``, ``fsdp_checkpoint``, ``resume``, ``method`` ("qlora" or "lora", for memory figures) and model sizes
(``d_model``, ``n_layer``, ``seq``).

Every rank prints ``RANK {...}`` (one write: ranks share stdout): the NF4 weights it holds (numel and a digest of
their codes, layer by layer), their bytes and those of all its parameters, their types (DTensor where sharded), its
peak RSS once the model is built (and quantized) and at the end, and its RSS at the end (Linux). A one-process run
also prints the digests of its codes cut into 2 row blocks, the shards 2 ranks must hold. Rank 0 writes the adapters
as ``lmcore.lora_state`` gathers them to ``RUN_DIR/adapters.safetensors``.

The data is a function of the global row index: a step trains on the same rows whatever the number of ranks, and
the position it saves (rows consumed) means the same on any number of ranks.
"""

import hashlib
import json
import os
import resource
import sys
from pathlib import Path

import torch

from lmcore import GPT, ModelConfig, apply_lora, lora_state
from lmcore.qlora import NF4Linear, nf4_local, quantize_frozen_linears
from trainloop import TrainConfig, Trainer

GLOBAL_ROWS = 8  # rows per optimizer step, split over the ranks
VOCAB = 97


class Rows:
    """This rank's share of consecutive global batches; ``pos`` counts the global rows consumed."""

    def __init__(self, micro: int, rank: int, world: int, seq: int) -> None:
        self.micro, self.rank, self.world, self.seq = micro, rank, world, seq
        self.pos = 0

    def __iter__(self):
        return self

    def _row(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        return (start + torch.arange(self.seq + 1)) % VOCAB  # (seq + 1,): a rule to learn

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.pos + self.rank * self.micro
        rows = torch.stack([self._row(i) for i in range(first, first + self.micro)])  # (micro, seq + 1)
        self.pos += self.micro * self.world
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds: its shards under FSDP, an NF4 weight as its stored tensors."""
    total = 0
    for param in model.parameters():
        local = nf4_local(param)
        if hasattr(local, "quantized_data"):  # torchao's NF4Tensor
            inner, _ = local.__tensor_flatten__()
            total += sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in inner)
        else:
            total += local.numel() * local.element_size()
    return total


def main() -> None:
    args = json.loads(sys.argv[1])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg = ModelConfig.from_preset("tiny", **{k: args[k] for k in ("d_model", "n_layer") if k in args})
    seq = args.get("seq", 16)
    torch.manual_seed(0)
    model = apply_lora(GPT(cfg), targets=["q", "v"], r=4, alpha=8.0)
    if args.get("method", "qlora") == "qlora":
        quantize_frozen_linears(model)
    built_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the fp32 model and its quantization
    engine = args.get("engine", "torch")
    fsdp = {"fsdp_checkpoint": args.get("fsdp_checkpoint", "sharded")} if engine == "fsdp" else {}
    train = TrainConfig(engine=engine, lr=3e-2, min_lr=1e-3, warmup_steps=1, max_steps=args.get("max_steps", 6),
                        save_every=args.get("save_every", 3), micro_batch=GLOBAL_ROWS // world,
                        log_every=1, progress=False, tensorboard=False, weight_decay=0.0,
                        **fsdp)  # fmt: skip
    data = Rows(train.micro_batch, rank, world, seq)
    out = Trainer(model, train, data, run_dir=args["run_dir"]).fit(resume=args.get("resume", False))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    held = {n: nf4_local(m.weight).quantized_data for n, m in layers.items()}  # this rank's codes (2 per byte)
    report = {
        "rank": rank,
        "world": world,
        "codes": {n: [codes.numel(), digest(codes)] for n, codes in held.items()},
        "quantized_bytes": sum(m.quantized_bytes() for m in layers.values()),
        "param_bytes": held_bytes(model),
        "weight_types": sorted({type(m.weight).__name__ for m in layers.values()}),
        "peak_rss_built_mib": built_peak,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_mib": int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20,
        "checkpoint": out["checkpoint"],
    }
    if world == 1:
        report["halves"] = {n: [digest(c) for c in m.weight.quantized_data.chunk(2)] for n, m in layers.items()}
    tensors = lora_state(model)  # a collective under FSDP: every rank gathers
    if rank == 0:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(args["run_dir"], "adapters.safetensors"))
    os.write(1, ("RANK " + json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main()
