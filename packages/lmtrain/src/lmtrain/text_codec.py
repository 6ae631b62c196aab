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
    """Token ids of `text`, encoded line by line with the newlines kept, as tokbin.encode_files does.

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
    lines = text.splitlines(keepends=True)
    return [i for ids in sp.encode(lines) for i in ids]


def decode(sp: Any, ids: list[int]) -> str:
    """Text of `ids` (ids past the tokenizer's vocabulary, possible from a padded model, are dropped)."""
    size = sp.get_piece_size()
    return sp.decode([int(i) for i in ids if 0 <= int(i) < size])


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
