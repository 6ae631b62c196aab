"""Lossless text <-> ids with the run's SentencePiece model, in the same unit as tokbin.encode_files.

`lmtrain prepare` trains the tokenizer so that decode(encode(text)) == text for any text (identity
normalisation, no dummy prefix, whitespace kept, "\\n" as a piece, byte fallback for unseen characters):
bits per byte are then exact, and Python source keeps its indentation.
"""

from __future__ import annotations

import json
from typing import Any

from lmtrain.errors import LmtrainError

# SentencePiece trainer options that make the tokenizer lossless (see the module docstring).
LOSSLESS_SPM_OPTIONS: dict[str, Any] = dict(
    byte_fallback=True,
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    user_defined_symbols=["\n"],
    # Bounded memory and time on big corpora: a random sample of lines trains the merges.
    input_sentence_size=2_000_000,
    shuffle_input_sentence=True,
    minloglevel=2,
)


def encode(sp: Any, text: str) -> list[int]:
    """Token ids of `text`, encoded line by line with the newlines kept, as tokbin.encode_files does (a base model's
    tokenizer encodes the text whole, no special tokens added).

    Example (a tokenizer `lmtrain prepare` trained on a little of the standard library's source):
        >>> import tempfile
        >>> import sentencepiece as spm
        >>> from lmtrain.examples import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> sp = spm.SentencePieceProcessor(model_file=str(tiny_data(work.name) / "tokenizer.model"))
        >>> ids = encode(sp, "to be\\nor not")
        >>> ids == sp.encode("to be\\n") + sp.encode("or not"), decode(sp, ids)
        (True, 'to be\\nor not')
        >>> work.cleanup()
    """
    if is_base_tokenizer(sp):  # a base model's tokenizer.json (tokbin.HFTokenizer): its own encoding of the text
        return list(sp.encode(text))
    lines = text.splitlines(keepends=True)
    return [i for ids in sp.encode(lines) for i in ids]


def decode(sp: Any, ids: list[int]) -> str:
    """Text of `ids` (ids past the tokenizer's vocabulary, possible from a padded model, are dropped)."""
    if is_base_tokenizer(sp):
        return str(sp.decode([int(i) for i in ids]))
    size = sp.get_piece_size()
    return sp.decode([int(i) for i in ids if 0 <= int(i) < size])


def is_base_tokenizer(tok: Any) -> bool:
    """Whether ``tok`` is a base model's tokenizer (tokbin's HFTokenizer, from a tokenizer.json) rather than the
    SentencePiece model of one of this toolkit's own runs."""
    return getattr(tok, "kind", None) == "hf"


def document_start(tok: Any, eos_id: int | None) -> int | None:
    """The id every document starts with, as training saw documents: this toolkit's own tokenizers put EOS in front;
    a base model's tokenizer its own BOS where it adds one (Llama 3's ``<|begin_of_text|>``), else nothing (Qwen2).

    Example:
        >>> class Qwen: kind, bos_id = "hf", None
        >>> document_start(Qwen(), 151645), document_start(object(), 2)
        (None, 2)
    """
    if is_base_tokenizer(tok):
        return tok.bos_id if tok.bos_id is not None and tok.encode("", add_special_tokens=True) else None
    return eos_id if eos_id is not None and eos_id >= 0 else None


def load_json_line(line: str | bytes, where: str) -> Any:
    """One line of a JSONL file parsed, or one LmtrainError naming ``where`` (file and line): text that is not JSON,
    and JSON nested too deeply for the parser (``[[[[...`` 100,000 deep: a RecursionError from the json module).

    Example:
        >>> load_json_line('{"prompt": "2+2?"}', "p.jsonl line 1")
        {'prompt': '2+2?'}
        >>> load_json_line("[" * 100_000 + "]" * 100_000, "p.jsonl line 2")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: p.jsonl line 2: expected a JSON object, found JSON nested deeper than ...
    """
    fix = "fix or remove the line"
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise LmtrainError(f"{where}: expected a JSON object, found text that is not JSON ({exc.msg}); {fix}") from None
    except RecursionError:
        raise LmtrainError(
            f"{where}: expected a JSON object, found JSON nested deeper than the parser goes (brackets or braces "
            f"opened thousands of times); {fix}"
        ) from None
