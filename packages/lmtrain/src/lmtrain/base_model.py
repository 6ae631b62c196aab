"""A Hugging Face base model as the start of a fine-tune: `lmtrain finetune --from DIR`.

DIR is a local model directory as transformers saves one (config.json, model.safetensors or a sharded index,
tokenizer.json, tokenizer_config.json, a chat template) of an architecture lmcore imports (Llama, Qwen2, Mistral:
lmcore.from_hf). The fine-tune trains lmcore's own model of that architecture, with the base's tokenizer (tokbin's
`HFTokenizer`) and chat template (rendered in a sandbox as transformers renders it: tokbin.encode_chat gives the ids
`apply_chat_template` gives, labels on each assistant reply and its end-of-turn token). The run directory keeps the
tokenizer files and records the base (`RunRecord.base`), so that `eval`, `generate` and `export` work from the run
alone and the export writes the base's architecture back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

# The files of a base's tokenizer a run keeps (those present): tokbin.load_tokenizer reads them from the run.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
DEFAULT_SEQ_LEN = 1024  # a base's own context (32k and more) is far past what a fine-tune's rows need


def is_base_dir(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (config.json, no run.json) rather than an lmtrain run."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "run.json").is_file()


@dataclass(frozen=True)
class BaseSource:
    """A base model directory, read and checked: its architecture, lmcore's model config for it, its tokenizer
    (tokbin) and that tokenizer's identity."""

    spec: str
    directory: Path
    architecture: str
    model_config: Mapping[str, Any]
    tokenizer: Any
    tokenizer_sha256: str

    def hf_source(self) -> dict[str, Any]:
        """lmcore's HFSource of the base as run.json keeps it (``base``): the architecture, config.json, the path."""
        from lmcore.hf_import import read_hf_config

        return {"architecture": self.architecture, "config": dict(read_hf_config(self.directory)),
                "directory": str(self.directory.resolve())}  # fmt: skip

    def record(self) -> dict[str, Any]:
        """What run.json keeps of where the weights came from (``finetune.from``)."""
        return {"base": str(self.directory.resolve()), "architecture": self.architecture,
                "tokenizer_sha256": self.tokenizer_sha256}  # fmt: skip

    def files(self) -> dict[str, Path]:
        """The tokenizer files the run keeps beside its checkpoints ({name: path in the base})."""
        return {name: self.directory / name for name in TOKENIZER_FILES if (self.directory / name).is_file()}


def read_base(spec: str) -> BaseSource:
    """The base model directory ``spec``, its config mapped (lmcore.hf_llama) and its tokenizer read (tokbin), the
    weights not yet: a directory lmcore cannot import, a missing or broken tokenizer, a template that does not
    render, or a tokenizer with ids past the model's vocabulary is one LmtrainError naming the file."""
    import tokbin
    from lmcore.hf_import import read_hf_config
    from lmcore.hf_llama import HFImportError, architecture_of, config_from_hf

    directory = Path(spec)
    try:
        raw = read_hf_config(directory)
        where = str(directory / "config.json")
        architecture, config = architecture_of(raw, where), config_from_hf(raw, where)
    except HFImportError as exc:
        raise LmtrainError(f"--from {spec}: {exc}") from None
    if not (directory / "tokenizer.json").is_file():
        raise LmtrainError(
            f"--from {spec}: no tokenizer.json: expected the base model's tokenizer beside its "
            "weights (transformers' tokenizer.save_pretrained writes it); copy it into the directory"
        )
    try:
        tokenizer = tokbin.load_tokenizer(directory)
    except tokbin.TokenFileError as exc:
        raise LmtrainError(f"--from {spec}: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise LmtrainError(
            f"--from {spec}: the tokenizer has ids up to {tokenizer.vocab_size - 1}, the model's vocab_size is "
            f"{config.vocab_size} ({where}): expected the tokenizer the model was trained with"
        )
    return BaseSource(spec, directory, architecture, config.to_dict(), tokenizer, tokenizer.sha256)


def chat_encoder(tokenizer: Any, where: str) -> Any:
    """A function ``turns -> (ids, labels)`` through the tokenizer's own chat template (tokbin.encode_chat); a
    tokenizer without a template, or a template that fails on a sample, is one LmtrainError."""
    import tokbin

    if tokenizer.chat_template is None:
        raise LmtrainError(
            f"{where}: the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja): expected a "
            "chat model's tokenizer, or add its template to tokenizer_config.json"
        )
    template = tokbin.ChatTemplate.for_tokenizer(tokenizer)

    def encode(turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[int]]:
        messages = [{"role": role, "content": content} for role, content in turns]
        try:
            encoded = tokbin.encode_chat(tokenizer, messages, template=template)
        except tokbin.TokenFileError as exc:
            raise LmtrainError(str(exc)) from None
        return list(encoded.ids), list(encoded.labels)

    return encode


def pad_id(tokenizer: Any) -> int:
    """The id that fills a padded row: the tokenizer's pad token, else its unknown token, else its EOS (rows are
    padded after their sample and the padding carries no label)."""
    for i in (tokenizer.pad_id, tokenizer.unk_id, tokenizer.eos_id, 0):
        if i is not None and 0 <= i < tokenizer.vocab_size:
            return int(i)
    return 0


def load_base_weights(source: BaseSource, config: Any, dtype: Any = None) -> Any:
    """The base's weights in lmcore's GPT built from ``config`` (the planned model: the base's, with what the plan
    may change without touching a tensor, such as dropout or activation checkpointing), in ``dtype`` (None: the
    checkpoint's own, bf16 for most published bases)."""
    from lmcore import from_hf
    from lmcore.hf_llama import HFImportError

    try:
        model = from_hf(source.directory, dtype=dtype, config=config)
    except HFImportError as exc:
        raise LmtrainError(f"--from {source.spec}: {exc}") from None
    return model.train()


def load_base_model(spec: str) -> tuple[Any, BaseSource]:
    """(lmcore's GPT with the base's weights, in eval mode; the base as :func:`read_base` reads it): the model as a
    fine-tune starts from it, to score before any step."""
    from lmcore import ModelConfig

    source = read_base(spec)
    return load_base_weights(source, ModelConfig.from_dict(dict(source.model_config))).eval(), source


def base_of(record: Any) -> Any:
    """The lmcore HFSource a fine-tune of a base recorded (None for a run of this toolkit's own models)."""
    if record.base is None:
        return None
    from lmcore.hf_llama import HFSource

    return HFSource.from_dict(dict(record.base))


def template_text(run_dir: Path) -> str | None:
    """The chat template a run of a base keeps with its tokenizer files, as text (None: none)."""
    jinja = run_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = run_dir / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None
