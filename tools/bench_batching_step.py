"""One fine-tuning step, padded against packed, in one process: forward and backward of a LoRA model (r=16) on a
batch of chat samples, padded to the batch's longest or packed into full rows (attention kept inside each sample),
and packed rows padded with EOS (every padding token then a one-token document for the varlen attention: the
fault fixed in lmtrain.chat.pad_id_for). Best of 4 steps each; tokens/s counts the samples' own tokens. Prints
ratios against the padded step; asserts nothing.

    python tools/bench_batching_step.py --run RUN --pairs instructions.jsonl [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()

    import torch

    from lmcore import apply_lora
    from lmtrain import chat
    from lmtrain.run_files import load_tokenizer, load_trained_model

    torch.set_num_threads(1)
    sp = load_tokenizer(args.run)
    train, _ = chat.split_samples(chat.read_samples(args.pairs), 0.1)
    samples = chat.encode_samples(sp, chat.template_for(sp), train, args.seq_len).samples
    real = sum(len(ids) - 1 for ids, _ in samples)
    pad = chat.pad_id_for(sp)
    rows = {"pad": len(samples), "pack": len(chat.pack_rows(samples, args.seq_len, pad))}
    results = {}
    for name, batching, separator, filler in (("padded", "pad", None, pad), ("packed", "pack", sp.eos_id(), pad),
                                              ("packed, EOS padding", "pack", sp.eos_id(), sp.eos_id())):  # fmt: skip
        model, _, _ = load_trained_model(args.run)
        model.config.document_separator = separator
        apply_lora(model.train(), r=16, alpha=32, dropout=0.05)
        batches = iter(chat.ChatBatches(samples, args.seq_len, args.batch, filler, batching=batching))
        best = float("inf")
        for _ in range(4):
            x, y = next(batches)
            t0 = time.perf_counter()
            model(x, y).loss.backward()
            best = min(best, time.perf_counter() - t0)
        per_row = real / rows[batching]
        results[name] = (best, per_row, args.batch * per_row / best, tuple(x.shape))
    base = results["padded"][2]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load average {load}; {len(samples)} samples, seq_len {args.seq_len}, batch {args.batch}")
    for name, (step, per_row, tps, shape) in results.items():
        print(f"{name:<22} step {step:.3f} s  shape {shape}  real tokens/row {per_row:.0f}  tokens/s {tps:,.0f}  "
              f"({tps / base:.2f}x padded)")  # fmt: skip


if __name__ == "__main__":
    main()
