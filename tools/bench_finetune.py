"""Fine-tuning side by side: `lmtrain finetune --method lora` against PEFT + transformers.Trainer, QLoRA against
LoRA, packing against padding, and BLEU-4 / ROUGE-L before and after. Prints figures and ratios; asserts nothing.

One pretrained model (``--run``, without biases, or the default recipe without biases trained here for
``--pretrain-s`` seconds on the standard library's source), one instruction set built from the standard library
(lmtrain.instructions, held out by module), the same LoRA settings, batch, steps, learning rate and schedule for
every side. Each side runs in a child process of its own, so its peak RSS (``ru_maxrss``) is its own. The PEFT
side trains the same model exported with `lmtrain export --format hf` (transformers' MPT) on the same token ids
(the exported tokenizer's chat template gives the toolkit's ids, tested in packages/lmtrain/tests/test_finetune.py),
padded per batch as transformers' Trainer does; MPT fuses q, k, v into one ``Wqkv`` layer, so its adapters on
``Wqkv`` and ``out_proj`` have the rank of ours but one A and one B for the three projections (the nearest PEFT
target to ours on q, k, v, o).

tokens/s counts the samples' own tokens (padding excluded): steps x batch rows x the mean real tokens per row of
that batching, over the summed step times (our Trainer.train_step, the Trainer's on_step_begin..on_step_end).

    python tools/bench_finetune.py [--run RUN] [--steps 60] [--batch 8] [--seq-len 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"r": 16, "alpha": 32.0, "dropout": 0.05, "lr": 1e-3, "warmup": 5, "min_lr": 2e-6}


def chat_pad(sp):
    from lmtrain.chat import pad_id_for

    return pad_id_for(sp)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (``ru_maxrss``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_train_steps() -> dict[str, float]:
    """Time every trainloop ``Trainer.train_step`` of this process from now on: ``{"s": seconds summed, "rss_mib":
    peak RSS at the end of the last step}`` (model loading and the steps, not the evaluation and save after them)."""
    import trainloop.trainer as trainer_module

    spent = {"s": 0.0, "rss_mib": 0.0}
    original = trainer_module.Trainer.train_step

    def timed(self, it):
        t0 = time.perf_counter()
        out = original(self, it)
        spent["s"] += time.perf_counter() - t0
        spent["rss_mib"] = peak_rss_mib()
        return out

    trainer_module.Trainer.train_step = timed
    return spent


def step_timer(spent: dict[str, float]):
    """A transformers TrainerCallback adding each step's seconds (on_step_begin..on_step_end) to ``spent["s"]`` and
    keeping the peak RSS at the end of the last step in ``spent["rss_mib"]``, as :func:`time_train_steps` does."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            spent["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            spent["s"] += time.perf_counter() - spent.pop("t0")
            spent["rss_mib"] = peak_rss_mib()

    return StepTimer()


def peft_arguments(out: Path, batch: int, steps: int, **extra):
    """transformers.TrainingArguments with SETTINGS' schedule (warmup, cosine to min_lr), AdamW betas (0.9, 0.95), no
    weight decay, clipping at 1.0 (lmtrain finetune's), on the CPU, no checkpoint; ``extra`` adds or replaces."""
    from transformers import TrainingArguments

    return TrainingArguments(**{
        "output_dir": str(out), "per_device_train_batch_size": batch, "max_steps": steps,
        "learning_rate": SETTINGS["lr"], "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr": SETTINGS["min_lr"]}, "warmup_steps": SETTINGS["warmup"], "weight_decay": 0.0,
        "adam_beta2": 0.95, "max_grad_norm": 1.0, "logging_steps": steps, "save_strategy": "no", "report_to": [],
        "use_cpu": True, "dataloader_num_workers": 0, "seed": 0, "remove_unused_columns": False, "disable_tqdm": True,
        **extra,
    })  # fmt: skip


def _mean_row_tokens(samples, seq_len, batching, eos):
    from lmtrain.chat import pack_rows

    if batching == "pad":
        return sum(len(ids) - 1 for ids, _ in samples) / len(samples)
    rows = pack_rows(samples, seq_len, eos)
    return sum(len(ids) - 1 for ids, _ in samples) / len(rows)


def _encoded(run, pairs, seq_len):
    import sentencepiece as spm

    from lmtrain import chat

    sp = spm.SentencePieceProcessor(model_file=str(Path(run) / "tokenizer.model"))
    train, val = chat.split_samples(chat.read_samples(pairs), 0.1)
    template = chat.template_for(sp)
    return (
        sp,
        chat.encode_samples(sp, template, train, seq_len).samples,
        chat.encode_samples(sp, template, val, seq_len),
    )


def side_ours(args) -> dict:
    """lmtrain finetune (lora or qlora, pack or pad), step times summed around Trainer.train_step."""
    from lmtrain.finetune_demo import heldout_response_loss
    from lmtrain.finetune_run import finetune

    spent = time_train_steps()
    sp, train, _ = _encoded(args.run, args.pairs, args.seq_len)
    out = Path(args.out) / f"ours-{args.method}-{args.batching}"
    settings = {"lr": SETTINGS["lr"], "min_lr": SETTINGS["min_lr"], "warmup_steps": SETTINGS["warmup"],
                "micro_batch": args.batch, "eval_every": 0, "save_every": 0, "log_every": args.steps}  # fmt: skip
    summary = finetune(f"{args.run}:best", args.pairs, out, method=args.method, batching=args.batching,
                       seq_len=args.seq_len, max_steps=args.steps, lora_r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"],
                       lora_dropout=SETTINGS["dropout"], overwrite=True, overrides=settings, quiet=True)  # fmt: skip
    tokens = args.steps * args.batch * _mean_row_tokens(train, args.seq_len, args.batching, chat_pad(sp))
    loss = heldout_response_loss(out, args.pairs, seq_len=args.seq_len, checkpoint="latest")
    result = {"tokens_per_s": tokens / spent["s"], "step_s": spent["s"] / args.steps, "loss": loss["loss"],
              "loss_se": loss.get("loss_se"), "loss_tokens": loss["tokens"], "steps": summary.step,
              "run": str(out)}  # fmt: skip
    if args.method == "qlora":
        import lmcore
        from lmcore.qlora import base_weight_bytes, quantize_frozen_linears
        from lmtrain.run_files import load_trained_model

        model, _, _ = load_trained_model(args.run)
        lmcore.apply_lora(model, ("q", "k", "v", "o"), SETTINGS["r"], SETTINGS["alpha"], SETTINGS["dropout"])
        result["base_bytes_bf16"] = base_weight_bytes(model)["bf16"]
        result["base_bytes_nf4"] = base_weight_bytes(quantize_frozen_linears(model))["stored"]
    return result


def side_peft(args) -> dict:
    """PEFT LoRA + transformers.Trainer on the MPT export of the same checkpoint, the same ids, padded per batch."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer

    sp, train, val = _encoded(args.run, args.pairs, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(args.hf)
    lora = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], lora_dropout=SETTINGS["dropout"],
                      target_modules=["Wqkv", "out_proj"], task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    eos = sp.eos_id()

    def collate(rows):
        width = max(len(r["ids"]) for r in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["ids"])] = torch.tensor(r["ids"])
            labels[i, : len(r["labels"])] = torch.tensor(r["labels"])
            mask[i, : len(r["ids"])] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}  # MPT shifts the labels itself

    spent = {"s": 0.0}
    training = peft_arguments(Path(args.out) / "peft", args.batch, args.steps)
    data = [{"ids": ids, "labels": labels} for ids, labels in train]
    timer = step_timer(spent)
    Trainer(model=model, args=training, train_dataset=data, data_collator=collate, callbacks=[timer]).train()
    model.eval()
    total = n = 0.0
    batch_losses = []
    with torch.no_grad():
        for i in range(0, len(val.samples), args.batch):
            b = collate([{"ids": s[0], "labels": s[1]} for s in val.samples[i : i + args.batch]])
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            target = b["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum",
                                                     ignore_index=-100)  # fmt: skip
            count = (target != -100).sum().item()
            total, n = total + loss.item(), n + count
            batch_losses.append(loss.item() / count)
    mean = sum(batch_losses) / len(batch_losses)
    se = (sum((x - mean) ** 2 for x in batch_losses) / (len(batch_losses) - 1)) ** 0.5 / len(batch_losses) ** 0.5
    tokens = args.steps * args.batch * _mean_row_tokens(train, args.seq_len, "pad", eos)
    return {"tokens_per_s": tokens / spent["s"], "step_s": spent["s"] / args.steps, "loss": total / n, "loss_se": se,
            "loss_tokens": n}  # fmt: skip


def side_scores(args) -> dict:
    """BLEU-4 and ROUGE-L of greedy answers to held-out prompts, for the pretrained run and the fine-tuned one."""
    from lmtrain.finetune_demo import heldout_prompts
    from lmtrain.generation_eval import evaluate_prompts

    prompts = heldout_prompts(args.pairs, Path(args.out) / "prompts.jsonl", args.prompts)
    before = evaluate_prompts(args.run, prompts, Path(args.out) / "gen-before.jsonl", max_new_tokens=96)
    after = evaluate_prompts(args.tuned, prompts, Path(args.out) / "gen-after.jsonl", checkpoint="latest",
                             max_new_tokens=96)  # fmt: skip
    return {"before": before, "after": after}


def child(args, side: str, **extra) -> dict:
    return run_child(__file__, side, {"run": args.run, "pairs": args.pairs, "out": args.out, "steps": args.steps,
                                      "batch": args.batch, "seq_len": args.seq_len, **extra})  # fmt: skip


def run_child(script: str, side: str, flags: dict, env: dict | None = None) -> dict:
    """Run ``script --side SIDE --flag=value ...`` in a fresh interpreter (its peak RSS its own) and return the JSON
    object its last ``{``-line prints; a failed side ends the benchmark with the child's stderr."""
    cmd = [sys.executable, script, "--side", side, *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run", default=None, help="pretrained run (default: train one here)")
    p.add_argument("--pretrain-s", type=float, default=240.0, help="pretraining budget when --run is not given")
    p.add_argument("--pairs", default=None)
    p.add_argument("--out", default="bench-finetune")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3, help="alternating ours / PEFT pairs for the speed ratio")
    p.add_argument("--method", default="lora")
    p.add_argument("--batching", default="pad")
    p.add_argument("--hf", default=None)
    p.add_argument("--tuned", default=None)
    args = p.parse_args()
    if args.side is not None:
        result = {"ours": side_ours, "peft": side_peft, "scores": side_scores}[args.side](args)
        result["peak_rss_mib"] = peak_rss_mib()
        print(json.dumps(result))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.run is None:
        from lmtrain.corpus import build_corpus
        from lmtrain.prepare_data import prepare
        from lmtrain.train_run import train

        build_corpus(out / "corpus.txt")
        prepare([out / "corpus.txt"], out / "data", val_fraction=0.05, progress=False)
        # Without biases: the model maps exactly onto transformers' MPT (lmcore.hf_mpt), which the PEFT side trains.
        train(
            out / "data",
            out / "pretrained",
            time_budget_s=args.pretrain_s,
            overwrite=True,
            quiet=True,
            overrides={"bias": False},
        )
        args.run = str(out / "pretrained")
    if args.pairs is None:
        from lmtrain.finetune_demo import DEMO_PAIR_CHARS, DEMO_PAIRS
        from lmtrain.instructions import write_instructions

        write_instructions(out / "pairs.jsonl", DEMO_PAIRS, DEMO_PAIR_CHARS)
        args.pairs = str(out / "pairs.jsonl")
    from lmtrain.export import export_run

    hf = out / "hf"
    export_run(args.run, hf, fmt="hf", force=True)
    print(f"load average at start: {loadavg()}; settings {SETTINGS}, steps "
          f"{args.steps}, batch {args.batch}, seq_len {args.seq_len}", flush=True)  # fmt: skip
    # The two sides alternate, ``--repeats`` times: on a shared machine the load moves between two runs, and the
    # ratio of one pair moved from 0.71 to 1.77 between two invocations (docs/benchmarks.md); the median is kept.
    pairs = []
    for _ in range(args.repeats):
        pairs.append((child(args, "ours", method="lora", batching="pad"), child(args, "peft", hf=str(hf))))
    ratios = sorted(o["tokens_per_s"] / p["tokens_per_s"] for o, p in pairs)
    ours, peft = pairs[0]
    packed = child(args, "ours", method="lora", batching="pack")
    qlora = child(args, "ours", method="qlora", batching="pad")
    scores = child(args, "scores", tuned=ours["run"], prompts=args.prompts)
    se = (ours["loss_se"] ** 2 + peft["loss_se"] ** 2) ** 0.5
    rows = [
        ("held-out response loss, ours (lora, pad)", f"{ours['loss']:.4f} +- {ours['loss_se']:.4f}"),
        ("held-out response loss, PEFT + Trainer", f"{peft['loss']:.4f} +- {peft['loss_se']:.4f}"),
        ("loss difference ours - PEFT (goal: <= its standard error)",
         f"{ours['loss'] - peft['loss']:+.4f} (se {se:.4f})"),
        ("finetune_tokens_per_s_vs_peft (goal >= 1.5), median",
         f"{ratios[len(ratios) // 2]:.2f} (each pair: {', '.join(f'{r:.2f}' for r in ratios)})"),
        ("tokens/s ours / PEFT", f"{ours['tokens_per_s']:.0f} / {peft['tokens_per_s']:.0f}"),
        ("peak RSS MiB ours / PEFT (goal: ours <= theirs)", f"{ours['peak_rss_mib']:.0f} / {peft['peak_rss_mib']:.0f}"),
        ("packing vs padding tokens/s (ours)", f"{packed['tokens_per_s'] / ours['tokens_per_s']:.2f}"),
        ("held-out loss packed", f"{packed['loss']:.4f} +- {packed['loss_se']:.4f}"),
        ("QLoRA base weight bytes / bf16 (goal <= 0.3)", f"{qlora['base_bytes_nf4'] / qlora['base_bytes_bf16']:.3f}"),
        ("held-out loss QLoRA - LoRA", f"{qlora['loss'] - ours['loss']:+.4f} (QLoRA {qlora['loss']:.4f})"),
        ("tokens/s QLoRA / LoRA", f"{qlora['tokens_per_s'] / ours['tokens_per_s']:.2f}"),
        (f"BLEU-4 before -> after ({scores['after']['count']} held-out prompts, greedy)",
         f"{scores['before']['bleu4']:.2f} -> {scores['after']['bleu4']:.2f}"),
        ("ROUGE-L F1 before -> after", f"{scores['before']['rougeL_f1']:.4f} -> {scores['after']['rougeL_f1']:.4f}"),
        ("exact match before -> after",
         f"{scores['before']['exact_match']:.3f} -> {scores['after']['exact_match']:.3f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"load average at end: {loadavg()}; {time.perf_counter() - t0:.0f} s; "
          f"held-out tokens {int(ours['loss_tokens'])}")  # fmt: skip
    (out / "results.json").write_text(json.dumps({"pairs": pairs, "packed": packed, "qlora": qlora,
                                                  "scores": scores}, indent=1))  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
