"""`lmtrain export --format gguf`: a run's checkpoint and SentencePiece tokenizer as one GGUF file for llama.cpp.

The weights go through lmcore.gguf_mpt (llama.cpp's MPT architecture); the vocabulary is the SentencePiece model's
pieces, scores and piece types, which are llama.cpp's token types. The end-of-document id is EOS and, added in
front of every text, BOS: training saw every document after it. No space prefix: the tokenizer adds none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrain.errors import WRITE_ERRNOS, LmtrainError, write_failure_message


def import_gguf() -> Any:
    """The gguf module, or a one-line LmtrainError naming the extra."""
    from lmcore.extras import MissingExtraError, import_extra

    try:
        return import_extra("gguf", "gguf", "lmtrain export --format gguf", dist="lmtrain")
    except MissingExtraError as exc:
        raise LmtrainError(str(exc)) from None


def check_file_destination(out: Path, force: bool) -> None:
    """Refuse, in one line, an --out that is not NAME.gguf, is a directory, or exists without --force."""
    if out.suffix != ".gguf":
        raise LmtrainError(f"--out {out}: --format gguf writes one file: name it NAME.gguf")
    if out.is_dir():
        raise LmtrainError(f"--out {out}: is a directory; name the file to write, e.g. {out / 'model.gguf'}")
    if out.exists() and not force:
        raise LmtrainError(f"--out {out}: exists; pass --force to replace it or choose another path")


def gguf_vocab(sp: Any, document_start: int | None) -> Any:
    """The run's SentencePiece model as an lmcore.gguf_mpt.GGUFVocab: every piece with its score and kind (the
    SentencePiece piece types are llama.cpp's token types: 1 normal ... 6 byte; user-defined pieces such as "\\n"
    are matched before the merges in both), the end-of-document id as EOS and, in front of every text, as BOS; no
    space prefix (the tokenizer adds none)."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    from lmcore.gguf_mpt import GGUFVocab

    proto = pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf module
    proto.ParseFromString(sp.serialized_model_proto())
    return GGUFVocab(
        tokens=[p.piece for p in proto.pieces],
        scores=[float(p.score) for p in proto.pieces],
        types=[int(p.type) for p in proto.pieces],
        eos_id=sp.eos_id() if document_start is None else document_start,
        bos_id=document_start,
        unk_id=sp.unk_id() if sp.unk_id() >= 0 else None,
        pad_id=sp.pad_id() if sp.pad_id() >= 0 else None,
        add_bos=document_start is not None,
        add_space_prefix=False,
    )


def write_run_gguf(
    model: Any, sp: Any, file: Path, *, context: int, gguf_type: str, document_start: int | None
) -> None:
    from lmcore.gguf_mpt import write_gguf

    if model.config.vocab_size != sp.get_piece_size():
        raise LmtrainError(
            f"--format gguf: the model's vocab_size {model.config.vocab_size} is not the tokenizer's "
            f"{sp.get_piece_size()} pieces; GGUF needs one token per embedding row"
        )
    try:
        write_gguf(model, file, gguf_vocab(sp, document_start), context_length=context, dtype=gguf_type)
    except OSError as exc:  # lmcore gives a write cut short its errno (a full disk, the file size limit)
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise LmtrainError(f"--format gguf: {write_failure_message(exc, str(file))}") from None
