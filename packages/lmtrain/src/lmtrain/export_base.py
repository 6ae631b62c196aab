"""`lmtrain export` of a fine-tune of a Hugging Face base model: the base's own architecture back.

`--format hf` (the default) writes the base's architecture (`Qwen2ForCausalLM` stays `Qwen2ForCausalLM`; lmcore
`save_hf`, the base's config.json with the trained weights) and the tokenizer files the run kept (tokenizer.json,
tokenizer_config.json, the chat template): `AutoModelForCausalLM` and `AutoTokenizer` load it with no custom code.
LoRA adapters are folded in (`--merge-lora`) or written as a PEFT adapter in `DIR/adapter` beside the base's own
weights, its `base_model_name_or_path` the base directory the run started from, so that `PeftModel.from_pretrained`
on the original base gives the merged model's logits. `--format gguf` writes llama.cpp's architecture of the base
("llama" or "qwen2", lmcore.gguf_llama) with the byte-level BPE vocabulary of tokenizer.json; llama.cpp names its
pre-tokenizer (`--gguf-pre`: "qwen2" for Qwen2 by default, given for the others).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

# llama.cpp's pre-tokenizer of each architecture where one name holds for all its models.
GGUF_PRE = {"Qwen2ForCausalLM": "qwen2"}


def write_base_export(model: Any, run: Any, run_dir: Path, tmp: Path, *, fmt: str, merge_lora: bool,
                      tokenizer: bool) -> str:  # fmt: skip
    """Write the export of a base's fine-tune into the empty directory ``tmp`` (the caller moves it into place);
    returns a line saying what was written."""
    from lmcore import merge_lora as merge
    from lmcore import save_hf, save_peft_adapter
    from lmcore.lora import lora_modules
    from lmtrain.base_model import TOKENIZER_FILES, base_of

    source = base_of(run)
    model.hf_source = source
    if fmt not in ("hf", "gguf"):
        raise LmtrainError(f"--format {fmt}: a fine-tune of {source.architecture} exports as its own architecture: "
                           "--format hf (or gguf)")  # fmt: skip
    adapters = bool(lora_modules(model))
    if adapters and merge_lora:
        merge(model)
        adapters = False
    extra = {"eos_token_id": run.eos_id} if run.eos_id is not None else None
    try:
        if adapters:
            save_hf(_without_adapters(model), tmp, architecture=source.architecture, extra_config=extra)
            save_peft_adapter(model, tmp / "adapter", base_model_name_or_path=source.directory)
        else:
            save_hf(model, tmp, architecture=source.architecture, extra_config=extra)
    except ValueError as exc:  # lmcore names the fields that do not map
        raise LmtrainError(f"{run_dir}: {exc}") from None
    if tokenizer:
        for name in TOKENIZER_FILES:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
    what = f"{source.architecture} (no custom code)"
    return what + (f", LoRA adapters in adapter/ (PEFT) for {source.directory}" if adapters else "")


def _without_adapters(model: Any) -> Any:
    """A copy of ``model`` without its adapters: the base weights it trained on top of."""
    import copy

    from lmcore.lora import LoRALinear

    plain = copy.deepcopy(model)
    for module in list(plain.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, child_name, child.base)
    plain.hf_source = model.hf_source
    return plain


def write_base_gguf(model: Any, run: Any, run_dir: Path, file: Path, *, gguf_type: str, pre: str | None,
                    merge_lora: bool) -> None:  # fmt: skip
    """One GGUF file of llama.cpp's architecture of the base, with the run's tokenizer as its vocabulary."""
    from lmcore import merge_lora as merge
    from lmcore.gguf_llama import bpe_vocab, write_gguf_llama
    from lmcore.lora import lora_modules
    from lmtrain.base_model import base_of

    source = base_of(run)
    if lora_modules(model):
        if not merge_lora:
            raise LmtrainError("--format gguf takes no separate adapters: add --merge-lora to fold them in")
        merge(model)
    pre = pre or GGUF_PRE.get(source.architecture)
    if pre is None:
        raise LmtrainError(f"--format gguf of a {source.architecture}: give --gguf-pre NAME, llama.cpp's name for its "
                           "tokenizer's pre-tokenizer (e.g. llama-bpe for Llama 3, smollm for SmolLM2)")  # fmt: skip
    try:
        write_gguf_llama(model, file, bpe_vocab(run_dir, pre=pre), architecture=source.architecture, dtype=gguf_type)
    except ValueError as exc:
        raise LmtrainError(f"{run_dir}: --format gguf: {exc}") from None


def export_note(on_note: Callable[[str], None] | None, line: str) -> None:
    if on_note is not None:
        on_note(f"wrote {line}")
