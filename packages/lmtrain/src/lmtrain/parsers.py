"""Every flag of the `lmtrain` command line, in one place.

The flags are relied on by users' scripts; keep them. `train` and `finetune` share the flags of a run
(:func:`add_run_flags`): the run directory, the end (steps, budget), resume, the engine, DeepSpeed, compile,
monitoring and `--set`. Abbreviations of a flag are not accepted (``allow_abbrev=False``), so that no flag swallows
another (``--tokenizer`` is not ``--tokenizer-sample-mb``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lmtrain.version import __version__

METHODS = ("full", "lora", "qlora")
ENGINES = ("torch", "fsdp", "deepspeed")


def seed(text: str) -> int:
    """An argparse type: a seed, a whole number in [0, 2**32) (numpy's and every other generator's range here)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to {2**32 - 1}, got {text!r}")
    return value


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        allow_abbrev=False,
        help="train a tokenizer on a corpus and encode train/val token files",
        description="Train a SentencePiece tokenizer on a sample of the training corpus, encode both splits with "
        "tokbin and write DATA_DIR/meta.json (files, token and byte counts, bytes per token). Memory stays flat "
        "whatever the corpus size.",
    )
    p.add_argument(
        "--text",
        nargs="+",
        required=True,
        metavar="PATH",
        help="training corpus: files, directories (recursive) or globs; .gz and .zst are decompressed",
    )
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output directory")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-text", nargs="+", metavar="PATH", help="validation corpus (files, directories, globs)")
    val.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="fraction of the documents held out for validation, chosen by a hash of each document's text, when "
        "--val-text is not given (default 0.1); plain text is then cut into documents after blank lines (every "
        "byte kept)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--jsonl-field", metavar="FIELD", help="the corpus is JSONL: a document per line, text in FIELD")
    fmt.add_argument("--parquet-column", metavar="COLUMN", help="the corpus is Parquet: a document per row (pyarrow)")
    p.add_argument("--split-docs", action="store_true", help="plain text: a document per blank-line-separated block")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines or Parquet rows")
    p.add_argument(
        "--clean",
        action="store_true",
        help="strip HTML tags, bracketed citation marks ([1], [citation needed]) and runs of whitespace from every "
        "document before the tokenizer trains and the text is encoded (web text; not for source code)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary size (default: tuned, see docs)")
    p.add_argument(
        "--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"], help="SentencePiece model type"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="RUN_OR_MODEL",
        help="encode with an existing tokenizer instead of training one: a run directory (its tokenizer.model) or a "
        "SentencePiece .model file; then `train --init-from RUN` continues that run on this data",
    )
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=200.0,
        metavar="MB",
        help="text the tokenizer trains on, spread evenly over the training corpus (default 200)",
    )
    p.add_argument("--workers", type=int, default=None, metavar="N", help="encoding processes (default: all CPUs)")
    p.add_argument(
        "--shard-mb",
        type=float,
        default=None,
        metavar="MB",
        help="write each split as a directory of shards of about MB input megabytes; rerun to resume",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on a prepared data directory",
        description="Single process by default; under torchrun or the deepspeed launcher it trains on all ranks "
        "(RANK, WORLD_SIZE, LOCAL_RANK from the environment).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="run.toml",
        help="a run file holding the whole run (data, out, recipe, budget, DeepSpeed JSON, [model]/[train]/"
        "[data_config] fields), or an earlier run's run.json; the flags below override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged run (flags over --config over the recipe) as a run file and exit, training nothing",
    )
    p.add_argument("--data", default=None, metavar="DATA_DIR", help="directory written by `lmtrain prepare`")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="run directory (metrics, checkpoints, plots)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default=None, help="lmcore preset name (default cpu-small)")
    model.add_argument("--model-config", default=None, metavar="config.json", help="model config JSON file")
    p.add_argument(
        "--document-attention",
        action="store_true",
        help="keep attention inside each document of the packed token stream: sets the model's "
        "document_separator to the training token file's EOS id (kept in the run's model config)",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="RUN[:best|latest|STEP]",
        help="start from the weights (and model config) of a checkpoint of another run (default: its best), with a "
        "fresh optimizer and schedule on --data; the run must have been trained with the data's tokenizer",
    )
    add_run_flags(p, "train")


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a trained run on chat data (full, LoRA or QLoRA)",
        description="Start from a checkpoint of a trained run and train on JSONL chat samples ('messages' lists "
        "of {role, content}, or 'prompt'/'response'; plain or gzip), only the assistant turns carrying labels. "
        "The same run flags as `train`: checkpoints, --resume, SIGTERM handling, time budget, engines, launchers.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="RUN[:best|latest|STEP]|DIR",
        help="the trained run to start from (default checkpoint: its best), or a Hugging Face model directory "
        "(Llama, Qwen2, Mistral: config.json, safetensors weights, tokenizer.json and its chat template)",
    )
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="chat samples, one JSON object per line")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory of the fine-tune")
    p.add_argument("--method", default="lora", choices=METHODS, help="what trains (default lora)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha; the update is scaled alpha / r")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument(
        "--lora-targets",
        default="q,k,v,o",
        metavar="q,k,v,o",
        help="linear layers to adapt: q, k, v, o, gate, up, down, or mlp (default q,k,v,o)",
    )
    p.add_argument(
        "--batching",
        default="pad",
        choices=("pack", "pad"),
        help="pad each batch to its longest sample (default: it measured faster than packing on a CPU, "
        "docs/benchmarks.md), or pack samples into full rows with attention kept inside each",
    )
    p.add_argument("--seq-len", type=int, default=None, help="row length (default: the source run's)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="samples held out by hash (default 0.1)")
    p.add_argument(
        "--too-long",
        default="truncate",
        choices=("truncate", "skip"),
        help="a sample longer than a row: keep its first seq_len + 1 tokens (default) or leave it out",
    )
    p.add_argument(
        "--trainable",
        default=None,
        metavar="all|attention|mlp|norms|embeddings|head|PATTERNS",
        help="--method full: what trains (default all), or comma-separated patterns on parameter names "
        "(layers.2[0-3].*); progressive unfreezing is a chain of runs, each --from the last",
    )
    add_run_flags(p, "finetune")


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The flags every command that trains takes: how the run ends, restarts, which engine, what it records."""
    p.add_argument("--json", action="store_true", help="end with the summary as one JSON object instead of a block")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="optimizer steps to train"
        + (" (default: one epoch of the training samples)" if command == "finetune" else ""),
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound on training wall-clock; without --max-steps the schedule (warmup and decay) is sized to it; ends "
        "with a final checkpoint and evaluation",
    )
    restart = p.add_mutually_exclusive_group()
    restart.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest usable checkpoint in RUN_DIR with the settings the run started with (none at "
        "all: start at step 0; some but none usable: stop, changing nothing). Every state file is read without "
        "unpickling code, DeepSpeed's included",
    )
    restart.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a RUN_DIR that holds checkpoints, deleting them (without it such a RUN_DIR is refused)",
    )
    _add_verify_flag(p, "the checkpoint --resume picks", "; rank 0 reads it while the other ranks wait")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="torch (one process, or DDP under torchrun; the default), fsdp (PyTorch's fully_shard: parameters, "
        "gradients and optimizer state sharded over the ranks, sharded checkpoints that resume on any number of "
        "ranks) or deepspeed (ZeRO; the default with --deepspeed)",
    )
    p.add_argument(
        "--deepspeed",
        default=None,
        metavar="ds_config.json",
        help="train with DeepSpeed and this config; the values it sets (batch keys, bf16/fp16, optimizer lr, betas, "
        "eps, weight_decay, a WarmupLR/WarmupDecayLR/WarmupCosineLR scheduler, gradient_clipping) become the run's, "
        '"auto" takes the run\'s value, and a value that differs from a --set one is an error',
    )
    _add_compile_flag(p)
    add_gradient_checkpointing_flag(p)
    p.add_argument(
        "--gpumon",
        action="store_true",
        help="record GPU (or host) metrics with gpumon into RUN_DIR/gpumon.HOST.csv (one file per node)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log to TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`; the "
        "tensorboard extra); RUN_DIR/loss.png is redrawn at every evaluation either way",
    )
    p.add_argument(
        "--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases under PROJECT (the wandb extra)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start even when the run's training state is estimated past the host's available memory (CPU runs)",
    )
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="key=value",
        help="override a field of the model or training config, e.g. --set save_every=10 --set precision=fp32"
        + (
            " (a fine-tune's model: only fields that change no shape, such as dropout)" if command == "finetune" else ""
        ),
    )


def add_gradient_checkpointing_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward (the model's checkpointing=block): less memory, "
        "about one more forward per step",
    )


def _add_compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the model with torch.compile (one graph, no breaks). Off by default: on a CPU an fp32 step "
        "measured no faster compiled and the first compile takes a minute or more; on a GPU it is the usual lever",
    )


def _add_verify_flag(p: argparse.ArgumentParser, what: str, wait: str = "") -> None:
    p.add_argument(
        "--verify",
        default="sizes",
        choices=["sizes", "full"],
        help=f"how {what} is checked against its manifest before use. sizes (default): every file present with "
        "its recorded size; reads only file metadata, and catches an interrupted or cut-short save. full: also "
        "recomputes every file's SHA-256, and catches altered bytes, but reads the whole checkpoint, weights and "
        f"optimizer state (12 bytes or more per parameter: over 15 GB for a 1.3B model){wait}",
    )


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default="best",
        metavar="best|latest|STEP|PATH",
        help="which checkpoint: the best evaluated (default; the latest when the run has no evaluation, with a note), "
        "the newest complete, a step number or a checkpoint directory",
    )
    _add_verify_flag(p, "the checkpoint")


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    _add_checkpoint_flags(p)
    _add_compile_flag(p)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype", default="fp32", metavar="fp32|bf16|fp16", help="weights and activations (default fp32; fp16: GPU)"
    )


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        allow_abbrev=False,
        help="sliding-window evaluation of a text file",
        description="Evaluate a checkpoint of the run on a text file with the run's tokenizer, in sliding windows "
        "over the whole text (every token scored exactly once). Under torchrun the windows are split across the "
        "ranks and the sums all-reduced: the same figures as one process.",
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory written by `lmtrain train`")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="FILE", help="text file to evaluate")
    what.add_argument(
        "--tasks",
        metavar="TASK,...",
        help="lm-evaluation-harness tasks instead (e.g. hellaswag,arc_easy,lambada_openai,wikitext; needs the "
        "harness extra); table and results.json in RUN_DIR/lm-eval/CHECKPOINT-TASKS or --out",
    )
    what.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="generate an answer to each prompt (chat 'messages' ending in the reference answer, or 'prompt' with "
        "'reference'/'response') and report BLEU-4, ROUGE-L and exact match (the eval extra: sacrebleu, rouge-score)",
    )
    harness = p.add_argument_group("with --tasks")
    harness.add_argument("--limit", type=float, default=None, help="documents per task (below 1: a fraction)")
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    harness.add_argument("--include-path", default=None, metavar="DIR", help="more task YAML files (local tasks)")
    harness.add_argument("--batch-size", type=int, default=None, help="sequences per forward (default 8)")
    harness.add_argument(
        "--bootstrap-iters", type=int, default=100000, help="bootstrap resamples for standard errors (0: none)"
    )
    harness.add_argument("--out", default=None, metavar="DIR", help="results directory (must not exist)")
    p.add_argument("--generations", metavar="FILE.jsonl", help="--prompts: where the prompts, references and "
                   "generations go (default RUN_DIR/generations-<checkpoint>.jsonl)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=256, help="--prompts: longest answer (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="--prompts: 0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=None, help="--prompts: sample from the k likeliest tokens")
    p.add_argument("--generation-seed", type=seed, default=None, help="--prompts: seed of the sampling")
    p.add_argument(
        "--force",
        action="store_true",
        help="--prompts: take prompts longer than 4 training contexts "
        "(ALiBi) or the model's context (RoPE), whose attention costs grow with the square of the length",
    )
    p.add_argument("--context", type=int, default=None, help="window length in tokens (default: training length)")
    p.add_argument("--stride", type=int, default=None, help="tokens scored per window (default: context / 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="repeat the evaluation N times per seed")
    p.add_argument(
        "--seeds",
        type=seed,
        nargs="+",
        default=None,
        help="seeds; each shifts the window grid by a seed-derived offset (protocol: mean and std over all runs)",
    )
    _add_device_flags(p)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a trained run", allow_abbrev=False)
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory written by `lmtrain train`")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--force", action="store_true", help="take a prompt longer than the model is meant to (see eval)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn of the run's chat template (a fine-tune's, or a base model's own): print "
        "the reply, ended by the template's end of turn",
    )
    _add_device_flags(p)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        allow_abbrev=False,
        help="write a checkpoint as a Hugging Face model directory (with its tokenizer)",
        description="Write a checkpoint of the run as a directory transformers loads: --format hf (the default) "
        "writes transformers' own MPT where the model maps onto it (no custom code; models without biases, "
        "LayerNorm, GELU, d_ff = 4 d_model, no GQA) and its own code otherwise (trust_remote_code=True), saying "
        "which; --format hf-mpt insists on MPT, --format hf-custom on the custom code. The tokenizer is converted "
        "and checked to give the same ids. Needs the hf extra (transformers, peft).",
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory written by `lmtrain train`")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (must be empty unless --force)")
    p.add_argument(
        "--format",
        default="hf",
        metavar="hf|hf-mpt|hf-custom|gguf",
        help="hf (default): MPT where the model maps, else custom code; hf-mpt: MPT or an error; hf-custom: own "
        "code; gguf: one file for llama.cpp (--out NAME.gguf; needs the gguf extra)",
    )
    p.add_argument("--outtype", default="f16", metavar="f16|f32", help="gguf: weights in f16 (default) or f32")
    _add_checkpoint_flags(p)
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="longest input of the MPT export (default: 4 training contexts)"
    )
    p.add_argument("--lora", default=None, metavar="FILE", help="LoRA adapters from lmcore's save_lora to export")
    p.add_argument(
        "--merge-lora", action="store_true", help="fold LoRA adapters into the weights instead of a PEFT adapter"
    )
    p.add_argument("--no-tokenizer", action="store_true", help="export the model alone")
    p.add_argument(
        "--gguf-pre",
        default=None,
        metavar="NAME",
        help="gguf of a fine-tuned Hugging Face base: llama.cpp's name for its tokenizer's pre-tokenizer (default: "
        "qwen2 for Qwen2; e.g. llama-bpe for Llama 3, smollm for SmolLM2)",
    )


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="preflight checks for a (multi-node) training run",
        description="One line per check: OK, WARN or FAIL with the fix. Exits non-zero on any FAIL.",
    )
    p.add_argument("--hostfile", default=None, metavar="FILE", help="hostfile (first host is the master)")
    p.add_argument("--preset", default=None, help="preset whose memory estimate is checked against the GPUs")
    p.add_argument("--data", default=None, metavar="DATA_DIR", help="prepared data directory to verify")

    def count(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
        return int(text)

    def gib(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):  # NaN compares false too
            raise argparse.ArgumentTypeError(f"expected a finite number of GiB > 0, got {text!r}")
        return value

    plan = p.add_argument_group("which configuration fits (a table instead of the checks)")
    plan.add_argument("--world", type=count, default=None, metavar="N", help="GPUs of the run, all nodes together "
                      "(with --from: FSDP over N beside one GPU; default 1 and 2)")  # fmt: skip
    plan.add_argument("--micro-batch", type=count, default=None, metavar="M", help="sequences per GPU per forward "
                      "(default: the preset's recipe; with --from, finetune's default)")  # fmt: skip
    plan.add_argument("--from", dest="source", default=None, metavar="DIR", help="a Hugging Face model directory "
                      "(config.json alone suffices): which of full fine-tuning, LoRA and QLoRA fit")  # fmt: skip
    plan.add_argument("--seq-len", type=count, default=None, metavar="T", help="with --from: tokens per row "
                      "(default: finetune's for a base, 1024 or the model's context if shorter)")  # fmt: skip
    plan.add_argument("--gpu-memory", type=gib, default=24.0, metavar="GB", help="one GPU's memory, GiB (24: RTX 3090)")
    plan.add_argument("--gpus-per-node", type=count, default=4, metavar="G", help="GPUs per node (4: the kit)")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        allow_abbrev=False,
        help="train a small model on this machine's Python standard library source (no download)",
        description="Builds a corpus from the Python standard library source, prepares it, trains cpu-small on "
        "CPU, evaluates, prints a sample and writes the loss plot.",
    )
    p.add_argument("--time-budget", type=float, default=180.0, metavar="SECONDS", help="training time (default 180)")
    p.add_argument(
        "--out", default="lmtrain-demo", metavar="DIR", help="where to write data and run (default ./lmtrain-demo)"
    )
    p.add_argument(
        "--finetune",
        action="store_true",
        help="then fine-tune with LoRA on instruction pairs built from the same source (signature and docstring -> "
        "body, held out by module) and print the held-out response loss and BLEU-4 before and after",
    )
    p.add_argument("--finetune-budget", type=float, default=120.0, metavar="SECONDS", help="fine-tuning time")
    p.add_argument("--base", default=None, metavar="DIR", help="with --finetune: skip the pretraining and fine-tune "
                   "this Hugging Face base model directory (Llama, Qwen2, Mistral) instead; 'smollm2' names the "
                   "SmolLM2-135M-Instruct directory tools/smollm2_base.py builds")  # fmt: skip


def run_flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--set`` pairs and the run flags that stand for a field (--gradient-checkpointing, --tensorboard, --wandb),
    as overrides: the same for every command that trains."""
    from lmtrain.overrides import parse_pairs

    overrides: dict[str, Any] = dict(parse_pairs(args.overrides))
    if args.gradient_checkpointing:
        overrides["model.checkpointing"] = "block"
    if args.tensorboard:
        overrides["train.tensorboard"] = True
    if args.wandb is not None:
        overrides["train.wandb_project"] = args.wandb
    return overrides


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `lmtrain`.

    Example:
        >>> build_parser().parse_args(["train", "--data", "d", "--out", "r", "--set", "log_every=1"]).overrides
        ['log_every=1']
    """
    parser = argparse.ArgumentParser(
        prog="lmtrain",
        description="Train ALiBi GPT models: prepare data, train, fine-tune, evaluate, generate, export, preflight "
        "checks, demo.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"lmtrain {__version__}")
    # The deepspeed launcher puts --local_rank=N before the subcommand (python -m lmtrain --local_rank=0 train ...).
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_prepare, _add_train, _add_finetune, _add_eval, _add_generate, _add_export, _add_doctor,
                _add_demo):  # fmt: skip
        add(sub)
    for command in sub.choices.values():
        command.add_argument(
            "--no-progress", action="store_true", help="no progress bars, plain log lines (the same as TQDM_DISABLE=1)"
        )
    return parser
