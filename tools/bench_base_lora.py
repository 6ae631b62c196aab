"""LoRA on Hugging Face base models, side by side: `lmtrain finetune --from DIR --method lora` against PEFT +
transformers.Trainer on the same directory, and `--method qlora` against LoRA. Prints figures and ratios; asserts
nothing.

Two bases by default: SmolLM2-135M-Instruct (a real Llama-family model; tools/smollm2_base.py builds its directory)
and a Qwen2ForCausalLM with random weights that this script writes itself (QWEN2 below: GQA, random q/k/v biases,
tied embeddings, SmolLM2's tokenizer and ChatML template). One instruction set from the standard library
(lmtrain.instructions, held out by module) encoded by the base's own chat template (labels on the assistant replies),
the same LoRA rank, alpha, dropout and targets (q, k, v, o: PEFT's q_proj, k_proj, v_proj, o_proj), precision,
threads, batch, row length, steps, learning rate and schedule on every side.

The PEFT side trains with transformers.Trainer on exactly our batches, in our order: lmtrain.chat.ChatBatches with
our seed, padded to each batch's longest, the targets shifted by one as ours are (a Trainer whose compute_loss is the
mean cross-entropy over the labelled targets, what lmcore's model computes; no attention mask, as ours has none:
rows are padded on the right, so a causal model's real positions never see the padding). Both sides are scored on
the same held-out batches by trainloop's evaluation (the mean over the answer tokens; the standard error from the
spread of the batches), ours by the fine-tune's own final evaluation. Each side runs in a child process of its own;
tokens/s counts the samples' own tokens (padding excluded) over the summed step times, and "peak RSS, steps" is the
child's ``ru_maxrss`` at the end of its last step (loading and training, not the evaluation and save after).

    python tools/bench_base_lora.py [--base DIR ...] [--steps 20] [--batch 4] [--seq-len 256] [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from bench_finetune import (  # tools/ is the script's directory, hence on sys.path
    SETTINGS,
    _mean_row_tokens,
    loadavg,
    peak_rss_mib,
    peft_arguments,
    run_child,
    step_timer,
    time_train_steps,
)
from smollm2_base import DEFAULT_OUT as SMOLLM2

# The Qwen2-architecture base: Qwen2's layout (GQA, biases on q, k and v only, SwiGLU, RMSNorm eps 1e-6, rope_theta
# 1e6, tied embeddings as in its smaller releases) at a size this CPU fine-tunes in minutes.
QWEN2 = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 1536, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
         "max_position_embeddings": 4096}  # fmt: skip
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_qwen2(out: Path, tokenizer_dir: Path) -> Path:
    """A Qwen2ForCausalLM of QWEN2's shape with random weights (seed 0; the q/k/v biases drawn from N(0, 0.02),
    which transformers would leave at zero) and the tokenizer files of ``tokenizer_dir``, saved by transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = json.loads((tokenizer_dir / "config.json").read_text())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=config["vocab_size"], bos_token_id=config.get("bos_token_id"),
                                         eos_token_id=config.get("eos_token_id"), **QWEN2))  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _encoded(base: str, pairs: str, seq_len: int):
    """(pad id, training samples, held-out samples) as `lmtrain finetune --from base` splits and encodes them."""
    from lmtrain import chat
    from lmtrain.base_model import chat_encoder, pad_id, read_base

    source = read_base(base)
    encode = chat_encoder(source.tokenizer, base)
    train, val = chat.split_samples(chat.read_samples(pairs), 0.1)
    return (pad_id(source.tokenizer), chat.encode_samples_with(encode, train, seq_len).samples,
            chat.encode_samples_with(encode, val, seq_len).samples)  # fmt: skip


def side_ours(args) -> dict:
    """lmtrain finetune --from BASE (lora or qlora, padded), step times summed around trainloop's train_step."""
    from lmtrain.finetune_run import finetune
    from lmtrain.run_record import read_run_record

    spent = time_train_steps()
    pad, train, _ = _encoded(args.base, args.pairs, args.seq_len)
    out = Path(args.out) / f"ours-{args.method}"
    settings = {"lr": SETTINGS["lr"], "min_lr": SETTINGS["min_lr"], "warmup_steps": SETTINGS["warmup"],
                "micro_batch": args.batch, "eval_every": 0, "save_every": 0, "log_every": args.steps,
                "precision": args.precision, **({} if args.score else {"eval_batches": 1})}  # fmt: skip
    summary = finetune(args.base, args.pairs, out, method=args.method, seq_len=args.seq_len, max_steps=args.steps,
                       lora_r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], lora_dropout=SETTINGS["dropout"],
                       overwrite=True, overrides=settings, quiet=True)  # fmt: skip
    run = read_run_record(out)
    tokens = args.steps * args.batch * _mean_row_tokens(train, args.seq_len, "pad", pad)
    result = {"tokens_per_s": tokens / spent["s"], "step_s": spent["s"] / args.steps, "steps": summary.step,
              "loss": summary.eval["loss"], "loss_se": summary.eval.get("loss_se", float("nan")),
              "loss_tokens": summary.eval["tokens"], "rss_steps_mib": spent["rss_mib"], "threads": run.cpu_threads,
              "matmul": run.cpu_matmul}  # fmt: skip
    if args.method == "qlora":
        import lmcore
        from lmcore.qlora import base_weight_bytes, quantize_frozen_linears

        model = lmcore.apply_lora(lmcore.from_hf(args.base), ("q", "k", "v", "o"), SETTINGS["r"], SETTINGS["alpha"])
        result["base_bytes_bf16"] = base_weight_bytes(model)["bf16"]
        result["base_bytes_nf4"] = base_weight_bytes(quantize_frozen_linears(model))["stored"]
    shutil.rmtree(out)  # a full copy of the base per checkpoint: several hundred MB for each run
    return result


def side_peft(args) -> dict:
    """PEFT LoRA + transformers.Trainer on the base directory, our batches in our order (see the module's note)."""
    import itertools

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer

    from lmtrain import chat
    from trainloop.evaluation import evaluate

    pad, train, val = _encoded(args.base, args.pairs, args.seq_len)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    lora = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], lora_dropout=SETTINGS["dropout"],
                      target_modules=PEFT_TARGETS, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    batches = list(itertools.islice(chat.ChatBatches(train, args.seq_len, args.batch, pad, batching="pad"), args.steps))

    def loss_of(x, y):  # (B, T) inputs and their targets, -100 where unlabelled: the mean over the labelled ones
        logits = model(input_ids=x).logits  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    class OurBatches(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(batches)

    class SameTargets(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = loss_of(inputs["input_ids"], inputs["labels"])
            return (loss, None) if return_outputs else loss

    spent = {"s": 0.0}
    training = peft_arguments(Path(args.out) / "peft", 1, args.steps, bf16=args.precision == "bf16")
    SameTargets(model=model, args=training, train_dataset=OurBatches(), callbacks=[step_timer(spent)],
                data_collator=lambda rows: {"input_ids": rows[0][0], "labels": rows[0][1]}).train()  # fmt: skip
    tokens = args.steps * args.batch * _mean_row_tokens(train, args.seq_len, "pad", pad)
    result = {"tokens_per_s": tokens / spent["s"], "step_s": spent["s"] / args.steps,
              "rss_steps_mib": spent["rss_mib"], "threads": torch.get_num_threads()}  # fmt: skip
    if args.score:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = evaluate(loss_of, model, chat.eval_batches(val, args.batch, pad))
        result.update(loss=loss["loss"], loss_se=loss.get("loss_se", float("nan")), loss_tokens=loss["tokens"])
    return result


def bench_base(args, base: str) -> dict:
    """Alternating ours / PEFT pairs, then QLoRA, on one base; prints and returns the figures."""
    flags = {"base": base, "pairs": args.pairs, "out": args.out, "steps": args.steps, "batch": args.batch,
             "seq_len": args.seq_len, "precision": args.precision}  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}

    def side(name, **extra):
        print(f"  {name} {extra or ''} (load {loadavg()[0]})", flush=True)
        return run_child(__file__, name, {**flags, **extra}, env)

    config = json.loads((Path(base) / "config.json").read_text())
    print(f"{base}: {config['architectures'][0]}, hidden {config['hidden_size']}, {config['num_hidden_layers']} "
          f"layers, {config['num_attention_heads']}/{config['num_key_value_heads']} heads, vocab "
          f"{config['vocab_size']}", flush=True)  # fmt: skip
    # The load on a shared machine moves between runs: the sides alternate and the median ratio is kept. The
    # held-out loss is the same figure in every pair (the same batches and seeds): scored in the first pair only.
    pairs = [(side("ours", method="lora", score=int(i == 0)), side("peft", score=int(i == 0)))
             for i in range(args.repeats)]  # fmt: skip
    qlora = side("ours", method="qlora", score=1)
    speed = sorted(o["tokens_per_s"] / p["tokens_per_s"] for o, p in pairs)
    rss = sorted(o["rss_steps_mib"] / p["rss_steps_mib"] for o, p in pairs)
    ours, peft = pairs[0]
    diff, se = ours["loss"] - peft["loss"], (ours["loss_se"] ** 2 + peft["loss_se"] ** 2) ** 0.5
    speed_median, rss_median = statistics.median(speed), statistics.median(rss)  # even count: mean of the middle two

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    rows = [
        ("held-out response loss, ours (LoRA)", f"{ours['loss']:.4f} +- {ours['loss_se']:.4f}"),
        ("held-out response loss, PEFT + Trainer", f"{peft['loss']:.4f} +- {peft['loss_se']:.4f}"),
        ("loss ours - PEFT (goal: <= the standard error)", f"{diff:+.4f} (se {se:.4f}): {met(diff <= se)}"),
        ("tokens/s ours / PEFT, median of pairs (goal >= 1.5)",
         f"{speed_median:.2f} (pairs: {', '.join(f'{r:.2f}' for r in speed)}): {met(speed_median >= 1.5)}"),
        ("tokens/s ours / PEFT, first pair", f"{ours['tokens_per_s']:.0f} / {peft['tokens_per_s']:.0f}"),
        ("peak RSS, steps, ours / PEFT, median (goal <= 0.8)",
         f"{rss_median:.2f} (pairs: {', '.join(f'{r:.2f}' for r in rss)}): {met(rss_median <= 0.8)}"),
        ("peak RSS, steps, MiB ours / PEFT, first pair", f"{ours['rss_steps_mib']:.0f} / {peft['rss_steps_mib']:.0f}"),
        ("peak RSS, whole child, MiB ours / PEFT", f"{ours['peak_rss_mib']:.0f} / {peft['peak_rss_mib']:.0f}"),
        ("QLoRA frozen linear weights NF4 / bf16",
         f"{qlora['base_bytes_nf4'] / qlora['base_bytes_bf16']:.3f} ({qlora['base_bytes_nf4'] / 2**20:.1f} MiB)"),
        ("peak RSS, steps, QLoRA / LoRA", f"{qlora['rss_steps_mib'] / ours['rss_steps_mib']:.2f} "
                                          f"({qlora['rss_steps_mib']:.0f} / {ours['rss_steps_mib']:.0f} MiB)"),
        ("held-out loss QLoRA - LoRA", f"{qlora['loss'] - ours['loss']:+.4f} (QLoRA {qlora['loss']:.4f} +- "
                                       f"{qlora['loss_se']:.4f})"),
        ("tokens/s QLoRA / LoRA", f"{qlora['tokens_per_s'] / ours['tokens_per_s']:.2f}"),
        ("threads ours / PEFT; our fp32 GEMMs", f"{ours['threads']} / {peft['threads']}; {ours['matmul']}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}", flush=True)
    return {"base": base, "pairs": pairs, "qlora": qlora}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--method", default="lora", help=argparse.SUPPRESS)
    p.add_argument("--score", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--base", action="append", default=None,
                   help=f"a Hugging Face model directory (repeatable; default {SMOLLM2} and QWEN2)")  # fmt: skip
    p.add_argument("--pairs", default=None, help="chat JSONL (default: instruction pairs built here)")
    p.add_argument("--n-pairs", type=int, default=800, help="instruction pairs to build when --pairs is not given")
    p.add_argument("--out", default="bench-base-lora")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="bf16: autocast on both sides")
    p.add_argument("--threads", type=int, default=1, help="threads of every side (OMP_NUM_THREADS)")
    p.add_argument("--repeats", type=int, default=3, help="alternating ours / PEFT pairs per base")
    args = p.parse_args()
    if args.side is not None:
        args.base = args.base[0]  # a child trains one base
        result = {"ours": side_ours, "peft": side_peft}[args.side](args)
        result["peak_rss_mib"] = peak_rss_mib()
        print(json.dumps(result))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.base is None:
        if not (SMOLLM2 / "model.safetensors").is_file():
            raise SystemExit(f"{SMOLLM2}: no SmolLM2 directory; build it with python tools/smollm2_base.py")
        qwen2 = out / "qwen2-random"
        if not (qwen2 / "model.safetensors").is_file():
            build_qwen2(qwen2, SMOLLM2)
        args.base = [str(SMOLLM2), str(qwen2)]
    if args.pairs is None:
        from lmtrain.finetune_demo import DEMO_PAIR_CHARS
        from lmtrain.instructions import write_instructions

        write_instructions(out / "pairs.jsonl", args.n_pairs, DEMO_PAIR_CHARS)
        args.pairs = str(out / "pairs.jsonl")
    print(f"load average at start: {loadavg()}; LoRA {SETTINGS}, {args.precision}, {args.threads} thread(s), "
          f"{args.steps} steps of {args.batch} rows, seq_len {args.seq_len}", flush=True)  # fmt: skip
    results = [bench_base(args, base) for base in args.base]
    print(f"load average at end: {loadavg()}; {time.perf_counter() - t0:.0f} s")
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
