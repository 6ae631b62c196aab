"""`lmtrain generate`: continue a prompt with a checkpoint of the run (the best evaluated one by default)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from lmtrain.errors import LmtrainError


def generate_text(
    run_dir: str,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int | None = None,
    checkpoint: str = "best",
    verify: str = "sizes",
    device: str | None = None,
    dtype: str = "fp32",
    on_note: Callable[[str], None] | None = None,
    compile: bool = False,
    chat: bool = False,
    force: bool = False,
) -> str:
    """The prompt followed by up to `max_new_tokens` sampled tokens, as text; with `chat`, the reply alone to the
    prompt as a user turn of the run's chat template (a fine-tune's, or a base model's own), ended by its end of turn.

    `checkpoint`, `verify`, `device` (None: cuda when available) and `dtype` ("fp32", "bf16", "fp16") as `lmtrain eval`
    takes them; `on_note` receives the note when the checkpoint asked for was not usable and another was taken;
    `compile` runs the model through torch.compile (lmcore.compile_model; it recompiles as the sequence grows).

    Example (`tiny_run`: 4 steps of the tiny preset, whose continuation is noise, but a seed repeats it):
        >>> import tempfile
        >>> from lmtrain.examples import tiny_run
        >>> work = tempfile.TemporaryDirectory()
        >>> run_dir = tiny_run(work.name)
        >>> text = generate_text(str(run_dir), "def main(", max_new_tokens=20, seed=0)
        >>> text.startswith("def main("), text == generate_text(str(run_dir), "def main(", max_new_tokens=20, seed=0)
        (True, True)
        >>> work.cleanup()
    """
    from lmtrain.devices import resolve_device, resolve_dtype
    from lmtrain.run_files import load_tokenizer, load_trained_model

    if max_new_tokens < 0:
        raise LmtrainError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise LmtrainError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise LmtrainError(f"--top-k must be >= 1, got {top_k}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes of another encoding on the command line reach argv as surrogates
        char = ord(prompt[exc.start])  # U+DC80..U+DCFF: the byte 0x80..0xFF as Python's surrogateescape keeps it
        shown = f"byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else f"the lone surrogate U+{char:04X}"
        raise LmtrainError(
            f"--prompt {prompt!r}: not UTF-8 text ({shown} at character {exc.start}); pass the prompt in UTF-8 "
            "(e.g. convert it with iconv)"
        ) from None
    where = resolve_device(device)
    model, run, path = load_trained_model(
        run_dir, str(where), checkpoint=checkpoint, verify=verify, dtype=resolve_dtype(dtype, where), on_note=on_note
    )
    if compile:
        import lmcore

        lmcore.compile_model(model)
    sp = load_tokenizer(run_dir)
    try:
        from lmtrain.generation_eval import generate_answers, longest_prompt

        if chat:
            return generate_answers(model, sp, run, [[("user", prompt)]], max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed, top_k=top_k, force=force)[0]  # fmt: skip
        from lmtrain.text_codec import encode

        if not force and len(encode(sp, prompt)) + 1 > longest_prompt(model, run):
            raise LmtrainError(
                f"--prompt: {len(encode(sp, prompt)):,} tokens, past the {longest_prompt(model, run):,} this model "
                "takes without --force (attention's time and memory grow with the square of the length): shorten "
                "the prompt, or add --force"
            )
        return continue_text(model, sp, prompt, run.eos_id, max_new_tokens, temperature=temperature,
                             top_k=top_k, seed=seed)  # fmt: skip
    except ValueError as exc:  # lmcore's one-line errors, e.g. NaN weights in a checkpoint of a diverged run
        raise LmtrainError(f"{path}: {exc}") from None


def continue_text(model: Any, sp: Any, prompt: str, eos_id: int | None, max_new_tokens: int, *,
                  temperature: float = 0.8, top_k: int | None = 200, seed: int | None = None) -> str:  # fmt: skip
    """``prompt`` followed by up to ``max_new_tokens`` tokens that ``model`` samples, as text, with the run's
    tokenizer ``sp`` (the document start in front, as documents start in training: EOS for this toolkit's own
    tokenizers, lmtrain.text_codec.document_start; generation stops at EOS)."""
    import torch

    from lmcore import generate
    from lmtrain.text_codec import decode, document_start, encode

    where = next(model.parameters()).device
    ids = encode(sp, prompt)
    start = document_start(sp, eos_id)
    # EOS in front marks the start of a document, as in training. With document attention (the separator is EOS)
    # that EOS would be a document of its own that the prompt never attends to, while cached decoding is plain
    # causal attention and would attend to it: leaving it out gives the prompt exactly its training context.
    document_attention = model.config.document_separator is not None and model.config.document_separator == start
    if start is not None and not (document_attention and ids):
        ids = [start] + ids
    top_k = None if top_k is None else min(top_k, model.config.vocab_size)
    out = generate(
        model,
        torch.tensor([ids], dtype=torch.long, device=where),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_id=eos_id,
        seed=seed,
    )
    new = [int(i) for i in out[0, len(ids) :].tolist()]
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id)]
    return prompt + decode(sp, new)


def run_generate(args: argparse.Namespace) -> int:
    """The `lmtrain generate` command."""
    print(
        generate_text(
            args.run,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            checkpoint=args.checkpoint,
            verify=args.verify,
            device=args.device,
            dtype=args.dtype,
            on_note=lambda note: print(f"lmtrain generate: {note}", file=sys.stderr),
            compile=args.compile,
            chat=args.chat,
            force=args.force,
        )
    )
    return 0
