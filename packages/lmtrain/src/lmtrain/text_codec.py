"""Lossless text <-> ids with the run's SentencePiece model, in the same unit as tokbin.encode_files.

`lmtrain prepare` trains the tokenizer so that decode(encode(text)) == text for any text (identity
normalisation, no dummy prefix, whitespace kept, "\\n" as a piece, byte fallback for unseen characters):
bits per byte are then exact, and Python source keeps its indentation.
"""

from __future__ import annotations

from typing import Any

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
