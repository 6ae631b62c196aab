"""`lmtrain export`: a run's checkpoint as a Hugging Face directory, with a tokenizer that gives our ids.

`--format hf` (the default) writes transformers' own MPT when the model maps onto it and the custom-code layout
otherwise, and says which it wrote and why. `--format hf-mpt` writes MPT (`config.json` with `model_type: mpt`,
`model.safetensors`), which `AutoModelForCausalLM.from_pretrained(DIR)` loads with no custom code; only models inside
MPT's shape map (no biases, LayerNorm, GELU with d_ff = 4 * d_model, n_kv_head = n_head, tied embeddings, fixed
slopes, no document separator), anything else is refused naming the fields. `--format hf-custom` takes any model:
the directory carries its own code (`trust_remote_code=True`). LoRA adapters (in the checkpoint, or `--lora FILE` from
`save_lora`) go to `DIR/adapter` in PEFT's layout on top of the MPT base, or are folded in with `--merge-lora`.

The tokenizer is the run's SentencePiece model converted by transformers' own converter into `tokenizer.json`;
before the directory is kept, the saved tokenizer is loaded back and must give exactly our ids on a check text
(newlines, indentation, unicode, bytes outside the vocabulary, every piece of the vocabulary) and decode it back;
otherwise the export is refused (SentencePiece unigram models can tie where the two libraries choose differently).
The tokenizer puts the end-of-document id in front of every text (its `bos_token`), as training saw documents and
`lmtrain generate` and `lmtrain eval` prompt the model, so `pipeline("text-generation")` gives `generate`'s
greedy output; its `model_max_length` is the training context (what `lmtrain eval` scores windows of; the MPT
export itself runs up to `max_seq_len`, 4 contexts by default). The SentencePiece model is copied beside it as
`tokenizer.model`, and the MPT config names its architecture `MPTForCausalLM` (the spelling of MosaicML's own
configs, which llama.cpp's converter registers; transformers loads the directory by `model_type` either way).

`--format gguf` writes one file for llama.cpp (lmtrain.export_gguf, lmcore.gguf_mpt): llama.cpp's MPT with
the SentencePiece vocabulary, the end-of-document id as BOS (added in front) and EOS, no space prefix.

Everything is written into a temporary directory beside DIR and renamed into place at the end: a failure leaves
nothing behind, and an existing non-empty DIR is replaced only with `--force`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError
from lmtrain.progress import step
from lmtrain.run_files import TOKENIZER_FILE
from lmtrain.run_record import RunRecord, read_run_record

FORMATS = ("hf", "hf-mpt", "hf-custom", "gguf")  # hf: MPT where the model maps, else hf-custom
GGUF_TYPES = ("f32", "f16")
# How llama.cpp's converter recognises the architecture (transformers' class is MptForCausalLM).
MPT_ARCHITECTURE = "MPTForCausalLM"
ADAPTER_DIR = "adapter"
# What the round-trip check encodes besides the vocabulary's own pieces.
CHECK_TEXT = (
    "def main(argv):\n    return 0  # indented\n\n\n\tTabbed line\r\nCRLF line  with  double  spaces \n"
    "  leading spaces and trailing   \n"
    "Ünïcödé — “quotes”, ﬁ ligature, 日本語のテキスト, emoji 🎉🦀, Z̷a̴l̶g̵o, \x00\x07\x7f control bytes\n"
    "</s><s><unk> literal marker text\n"
)


def _import_hf(module: str) -> Any:
    from lmcore.extras import MissingExtraError, import_hf

    try:
        return import_hf(module, "lmtrain export", dist="lmtrain")
    except MissingExtraError as exc:
        raise LmtrainError(str(exc)) from None


def _require_protobuf() -> None:
    """The tokenizer's conversion reads the SentencePiece model with protobuf, which the hf extra brings."""
    try:
        importlib.import_module("google.protobuf")
    except ModuleNotFoundError as exc:
        if exc.name not in ("google", "google.protobuf"):
            raise
        from lmcore.extras import extra_hint

        raise LmtrainError(
            "lmtrain export needs protobuf (to convert the tokenizer), which is not installed: "
            f"{extra_hint('hf', 'lmtrain')} (or --no-tokenizer to export the model alone)"
        ) from None


def hf_tokenizer(
    sp_model_path: str | os.PathLike, model_max_length: int | None = None, document_start: int | None = None
) -> Any:
    """The SentencePiece model at `sp_model_path` as a transformers fast tokenizer (transformers' SpmConverter).

    Special tokens are never matched inside text (`split_special_tokens`), as SentencePiece encodes "</s>" in
    text as characters. With `document_start` (an id), that token is the tokenizer's `bos_token` and is put in
    front of every text encoded with special tokens (the default of `tokenizer(text)`).

    Example (needs the hf extra; a tokenizer `lmtrain prepare` trained on a little of the standard library's source):
        >>> import tempfile
        >>> import sentencepiece as spm
        >>> from lmtrain.examples import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> sp = spm.SentencePieceProcessor(model_file=str(tiny_data(work.name) / "tokenizer.model"))
        >>> hf = hf_tokenizer(f"{work.name}/data/tokenizer.model")  # the tokenizer tiny_data() prepared
        >>> hf("def f():\\n    return 1\\n")["input_ids"] == sp.encode("def f():\\n    return 1\\n")
        True
        >>> work.cleanup()
    """
    transformers = _import_hf("transformers")
    _require_protobuf()
    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(Path(sp_model_path).read_bytes())
    if proto.trainer_spec.model_type == 2:  # BPE: merges come from the piece scores
        vocab: Any = {p.piece: i for i, p in enumerate(proto.pieces)}
    else:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if tokenizer is None:
        raise LmtrainError(f"{sp_model_path}: transformers cannot convert this SentencePiece model type")
    sp = spm.SentencePieceProcessor(model_file=str(sp_model_path))
    special = {
        f"{name}_token": sp.id_to_piece(i)
        for name, i in (("unk", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id()))
        if 0 <= i < sp.get_piece_size()
    }
    if document_start is not None:
        special["bos_token"] = sp.id_to_piece(document_start)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        split_special_tokens=True,
        model_max_length=model_max_length or int(1e30),
        add_bos_token=document_start is not None,
        **special,
    )


def tokenizer_check_text(sp: Any) -> str:
    """CHECK_TEXT followed by every normal piece of the vocabulary as text (which exercises every merge)."""
    pieces = [
        sp.id_to_piece(i).replace("\u2581", " ")
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
    ]
    return CHECK_TEXT + "|".join(pieces) + "\n"


def _first_difference(a: Any, b: Any) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_tokenizer(sp: Any, hf: Any, text: str, where: str, document_start: int | None = None) -> None:
    """Raise LmtrainError unless `hf` gives `sp`'s ids on `text` (as `lmtrain` encodes it), with `document_start`
    in front when special tokens are added, and decodes them back."""
    from lmtrain.text_codec import encode

    ours = encode(sp, text)
    theirs = hf(text, add_special_tokens=False, verbose=False)["input_ids"]  # no "longer than max length" note
    prefix = [] if document_start is None else [document_start]
    if hf(text[:200], verbose=False)["input_ids"] != prefix + encode(sp, text[:200]):
        raise LmtrainError(
            f"{where}: the converted tokenizer does not put the document-start id {document_start} in front; "
            "export with --no-tokenizer"
        )
    if ours != theirs:
        at = _first_difference(ours, theirs)
        raise LmtrainError(
            f"{where}: the Hugging Face conversion of the tokenizer disagrees with SentencePiece at token {at} of the "
            f"check text ({sp.id_to_piece(ours[at : at + 3])} vs {hf.convert_ids_to_tokens(theirs[at : at + 3])}); "
            "refusing to write a tokenizer that changes the ids: export with --no-tokenizer"
        )
    back = hf.decode(theirs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != text:
        at = _first_difference(back, text)
        raise LmtrainError(
            f"{where}: the converted tokenizer decodes the check text differently at character {at} "
            f"({back[at : at + 10]!r} vs {text[at : at + 10]!r}); export with --no-tokenizer"
        )


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise LmtrainError(f"--out {out}: exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LmtrainError(f"--out {out}: directory is not empty; pass --force to replace it or choose another path")


def _write_model(model: Any, tmp: Path, fmt: str, final: Path, *, max_seq_len: int | None, token_ids: dict) -> None:
    import json

    from lmcore.lora import lora_modules

    if fmt == "hf-custom":
        from lmcore.hf_custom import save_custom

        extra = {k: v for k, v in token_ids.items() if v is not None}
        adapters = tmp / ADAPTER_DIR if lora_modules(model) else None  # named after the base where it will be
        save_custom(model, tmp, extra_config=extra, adapter_dir=adapters, base_name=str(final.resolve()))
        return
    from lmcore.hf_mpt import to_mpt, to_peft

    hf = to_mpt(model, max_seq_len, **token_ids)
    hf.save_pretrained(tmp)
    config_file = tmp / "config.json"  # save_pretrained writes the class name; llama.cpp looks for MosaicML's
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["architectures"] = [MPT_ARCHITECTURE]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if lora_modules(model):
        # The base is not in place yet: nothing for PEFT to compare embeddings against (they are never adapted).
        to_peft(model, hf, str(final.resolve())).save_pretrained(tmp / ADAPTER_DIR, save_embedding_layers=False)


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str = "hf",
    checkpoint: str = "best",
    verify: str = "sizes",
    force: bool = False,
    max_seq_len: int | None = None,
    lora: str | os.PathLike | None = None,
    merge_lora: bool = False,
    tokenizer: bool = True,
    gguf_type: str = "f16",
    on_note: Callable[[str], None] | None = None,
    progress: bool = False,
    gguf_pre: str | None = None,
) -> Path:
    """Export the run's `checkpoint` to `out` in `fmt`; returns the checkpoint exported.

    `fmt` "hf" writes MPT when the model maps onto it and the custom-code layout otherwise (`on_note` hears which and
    why), "hf-mpt" writes MPT or refuses naming the fields that do not map, "hf-custom" writes the custom-code layout,
    "gguf" one file NAME.gguf of llama.cpp's MPT in `gguf_type` ("f16" or "f32").

    `verify` ("sizes" or "full") says how the checkpoint is checked first, as `load_trained_model` takes it.
    `progress` writes a timestamped line as each long step (the tokenizer's check, the weights) starts and ends.

    Example (needs the hf extra; `tiny_run`: 4 steps of the tiny preset without biases, which maps onto MPT):
        >>> import os, tempfile, torch
        >>> from transformers import AutoModelForCausalLM
        >>> from lmtrain.examples import tiny_run
        >>> from lmtrain.run_files import load_trained_model
        >>> work = tempfile.TemporaryDirectory()
        >>> run_dir = tiny_run(work.name)
        >>> out = os.path.join(work.name, "export")
        >>> exported = export_run(run_dir, out, fmt="hf", checkpoint="best")
        >>> sorted(os.listdir(out))  # doctest: +ELLIPSIS
        ['config.json', ...'model.safetensors', 'tokenizer.json', ...]
        >>> hf = AutoModelForCausalLM.from_pretrained(out)
        >>> model, _, _ = load_trained_model(run_dir, checkpoint=str(exported))
        >>> ids = torch.randint(0, 400, (1, 40))
        >>> type(hf).__name__, torch.allclose(hf(ids).logits, model(ids).logits, atol=1e-5)
        ('MptForCausalLM', True)
        >>> work.cleanup()
    """
    from lmtrain.run_files import load_tokenizer, load_trained_model

    _check_arguments(fmt, max_seq_len, gguf_type, tokenizer)
    out = Path(out)
    if read_run_record(run_dir).base is not None:  # a fine-tune of a Hugging Face base: its own architecture back
        return _export_base(run_dir, out, fmt=fmt, checkpoint=checkpoint, verify=verify, force=force, lora=lora,
                            merge_lora=merge_lora, tokenizer=tokenizer, gguf_type=gguf_type, gguf_pre=gguf_pre,
                            on_note=on_note)  # fmt: skip
    _check_extras_and_destination(out, fmt, force, tokenizer)
    model, run, path = load_trained_model(run_dir, checkpoint=checkpoint, verify=verify, on_note=on_note,
                                          set_threads=False)  # fmt: skip
    if lora is not None:
        _load_lora_file(model, lora)
    asked, fmt, mismatches = fmt, *_layout(model, path, fmt, merge_lora)
    _drop_packed_attention(model, run, on_note)
    if fmt == "gguf":
        from lmcore.gguf_mpt import gguf_mismatches

        if gguf_bad := gguf_mismatches(model.config):
            raise LmtrainError(
                f"{path}: --format gguf: the model does not map onto llama.cpp's MPT ({'; '.join(gguf_bad)})"
            )
    sp = load_tokenizer(run_dir) if tokenizer else None
    eos_id = run.eos_id
    # The end-of-document id opens every document in training, so it is the export's BOS too.
    document_start = eos_id if isinstance(eos_id, int) and eos_id >= 0 else None
    with _staged(out) as tmp:
        if fmt == "gguf":
            _write_gguf(model, sp, tmp / out.name, max_seq_len, gguf_type, document_start)
            _follow_umask(tmp)
            os.replace(tmp / out.name, out)
            return path
        if sp is not None:  # first: a tokenizer that fails its check stops the export before the weights are written
            sp_path = Path(run_dir) / TOKENIZER_FILE
            with step("export: the tokenizer converted and checked against SentencePiece", enabled=progress, bar=False):
                _write_tokenizer(sp, sp_path, tmp, run.seq_len, document_start,
                                 chat_template=_chat_template(run, Path(run_dir)))  # fmt: skip
            shutil.copyfile(sp_path, tmp / TOKENIZER_FILE)  # what llama.cpp's converter reads the vocabulary from
        with step(f"export: the weights ({fmt.removeprefix('hf-')} layout) -> {out}", enabled=progress, bar=False):
            token_ids = {"eos_token_id": eos_id, "bos_token_id": document_start}
            _write_model(model, tmp, fmt, out, max_seq_len=max_seq_len, token_ids=token_ids)
        _follow_umask(tmp)
        _replace(tmp, out)
    if on_note is not None and asked == "hf":
        on_note(
            "wrote transformers' MPT (loads with no custom code)"
            if fmt == "hf-mpt"
            else "wrote custom code (loads with trust_remote_code=True): the model does not map onto "
            f"transformers' MPT ({'; '.join(mismatches)})"
        )
    return path


def _export_base(run_dir: str | os.PathLike, out: Path, *, fmt: str, checkpoint: str, verify: str, force: bool,
                 lora: str | os.PathLike | None, merge_lora: bool, tokenizer: bool, gguf_type: str,
                 gguf_pre: str | None, on_note: Callable[[str], None] | None) -> Path:  # fmt: skip
    """export_run for a fine-tune of a Hugging Face base (lmtrain.export_base)."""
    from lmtrain.export_base import write_base_export, write_base_gguf
    from lmtrain.run_files import load_trained_model

    if fmt == "gguf":
        from lmtrain.export_gguf import check_file_destination, import_gguf

        check_file_destination(out, force)
        import_gguf()
    else:
        _check_destination(out, force)
    model, run, path = load_trained_model(run_dir, checkpoint=checkpoint, verify=verify, on_note=on_note,
                                          set_threads=False)  # fmt: skip
    if lora is not None:
        _load_lora_file(model, lora)
    with _staged(out) as tmp:
        if fmt == "gguf":
            write_base_gguf(model, run, Path(run_dir), tmp / out.name, gguf_type=gguf_type, pre=gguf_pre,
                            merge_lora=merge_lora)  # fmt: skip
            _follow_umask(tmp)
            os.replace(tmp / out.name, out)
            return path
        what = write_base_export(model, run, Path(run_dir), tmp, fmt=fmt, merge_lora=merge_lora, tokenizer=tokenizer)
        _follow_umask(tmp)
        _replace(tmp, out)
    if on_note is not None:
        on_note(f"wrote {what}")
    return path


def _check_arguments(fmt: str, max_seq_len: int | None, gguf_type: str, tokenizer: bool) -> None:
    if fmt not in FORMATS:
        raise LmtrainError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if max_seq_len is not None and max_seq_len < 1:
        raise LmtrainError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    if gguf_type not in GGUF_TYPES:
        raise LmtrainError(f"--outtype {gguf_type!r}: expected one of {', '.join(GGUF_TYPES)}")
    if fmt == "gguf" and not tokenizer:
        raise LmtrainError("--format gguf holds the tokenizer: drop --no-tokenizer")


def _check_extras_and_destination(out: Path, fmt: str, force: bool, tokenizer: bool) -> None:
    """Before the checkpoint is read: the extras the format needs are installed, and ``out`` may be written."""
    if fmt == "gguf":
        from lmtrain.export_gguf import check_file_destination, import_gguf

        check_file_destination(out, force)
        import_gguf()
        return
    _check_destination(out, force)
    _import_hf("transformers")
    if tokenizer:
        _require_protobuf()


def _load_lora_file(model: Any, lora: str | os.PathLike) -> None:
    from safetensors import SafetensorError

    from lmcore import load_lora

    try:
        load_lora(model, lora)
    except (ValueError, OSError, SafetensorError) as exc:
        said = str(exc)  # lmcore's messages begin with the file's path
        raise LmtrainError(f"--lora {said}" if said.startswith(str(lora)) else f"--lora {lora}: {said}") from None


def _layout(model: Any, path: Path, fmt: str, merge_lora: bool) -> tuple[str, list[str]]:
    """(the layout --format writes for this model, the fields that keep it off MPT); LoRA adapters are folded in
    (--merge-lora) or refused where the layout takes none."""
    from lmcore import merge_lora as merge
    from lmcore.hf_mpt import mpt_mismatches
    from lmcore.lora import lora_modules

    bad = mpt_mismatches(model.config)
    asked, fmt = fmt, written_format(fmt, bad)
    if asked == "hf-mpt" and bad:
        raise LmtrainError(
            f"{path}: the model does not map onto transformers' MPT ({'; '.join(bad)}): "
            "export with --format hf-custom or hf (loads with trust_remote_code=True)"
        )
    if lora_modules(model):
        if merge_lora:
            try:
                merge(model)
            except ValueError as exc:  # NaN adapters, or a base changed under them
                raise LmtrainError(f"--merge-lora: {exc}") from None
        elif fmt == "gguf":
            raise LmtrainError("--format gguf takes no separate adapters: add --merge-lora to fold them in")
        else:  # a PEFT adapter directory on the MPT or the custom-code base
            _import_hf("peft")
    return fmt, bad


def _drop_packed_attention(model: Any, run: RunRecord, on_note: Callable[[str], None] | None) -> None:
    """Packing kept each training sample's attention to itself; a chat holds no EOS before its end, so plain causal
    attention computes the same for it (and generation with a KV cache never used the separator)."""
    if (run.finetune or {}).get("batching") == "pack" and model.config.document_separator == run.eos_id:
        model.config.document_separator = None
        if on_note is not None:
            on_note("the fine-tune's packed-sample attention (document_separator = EOS) is left out of the export")


def _write_gguf(model: Any, sp: Any, file: Path, max_seq_len: int | None, gguf_type: str,
                document_start: int | None) -> None:  # fmt: skip
    from lmcore.hf_mpt import DEFAULT_CONTEXT_MULTIPLE
    from lmtrain.export_gguf import write_run_gguf

    context = max_seq_len or DEFAULT_CONTEXT_MULTIPLE * model.config.context_length
    write_run_gguf(model, sp, file, context=context, gguf_type=gguf_type, document_start=document_start)


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write the export into; on any failure it goes, with the parent
    directories made for it, and nothing is left behind."""
    tmp = out.parent / f".{out.name}.tmp-export-{os.getpid()}"
    created = []  # parent directories made for the export, removed again if it fails
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # deepest first
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise
    finally:
        if tmp.is_dir() and not any(tmp.iterdir()):
            tmp.rmdir()


def written_format(fmt: str, mismatches: list[str]) -> str:
    """The layout `--format fmt` writes for a model with these MPT `mismatches`: "hf-mpt" or "hf-custom".

    Example:
        >>> written_format("hf", []), written_format("hf", ["bias=True"]), written_format("hf-custom", [])
        ('hf-mpt', 'hf-custom', 'hf-custom')
    """
    if fmt == "hf":
        return "hf-custom" if mismatches else "hf-mpt"
    return fmt


def _chat_template(run: RunRecord, run_dir: Path) -> str | None:
    """The Jinja chat template of a fine-tuned run (lmtrain.chat), None for a run without one."""
    if run.chat_template is None:
        return None
    from lmtrain.chat import ChatTemplate

    return ChatTemplate.from_json(run.chat_template, str(run_dir / "run.json")).jinja()


def _write_tokenizer(sp: Any, sp_path: Path, directory: Path, model_max_length: int | None,
                     document_start: int | None, chat_template: str | None = None) -> None:  # fmt: skip
    """Convert, save, load back with AutoTokenizer and check, in a subdirectory of its own (AutoTokenizer would
    otherwise read the model's config, which asks for remote code in a custom export); then move the files up.
    ``chat_template`` (Jinja) becomes the tokenizer's ``chat_template``."""
    check_dir = directory / ".tokenizer"
    hf = hf_tokenizer(sp_path, model_max_length, document_start)
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(check_dir)
    reloaded = _import_hf("transformers").AutoTokenizer.from_pretrained(str(check_dir))
    check_tokenizer(sp, reloaded, tokenizer_check_text(sp), str(sp_path), document_start)
    for f in check_dir.iterdir():
        os.replace(f, directory / f.name)
    check_dir.rmdir()


def _follow_umask(directory: Path) -> None:
    """Give every file the mode the umask implies (transformers writes its weights file 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in directory.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an existing `out` (empty, or --force) is moved aside first, then deleted."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-export-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def run_export(args: argparse.Namespace) -> int:
    """The `lmtrain export` command."""
    checkpoint = export_run(
        args.run,
        args.out,
        fmt=args.format,
        checkpoint=args.checkpoint,
        verify=args.verify,
        force=args.force,
        max_seq_len=args.max_seq_len,
        lora=args.lora,
        merge_lora=args.merge_lora,
        tokenizer=not args.no_tokenizer,
        gguf_type=args.outtype,
        on_note=lambda note: print(f"lmtrain export: {note}", file=sys.stderr),
        progress=True,
        gguf_pre=args.gguf_pre,
    )
    config = {} if args.format == "gguf" else json.loads((Path(args.out) / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if args.format == "gguf":
        base = read_run_record(args.run).base
        what = f"{base['architecture']}'s llama.cpp architecture" if base else "llama.cpp's MPT"
        print(f"exported {checkpoint} to {args.out} (gguf {args.outtype}; {what})")
        return 0
    custom = "auto_map" in config
    mpt = "transformers' MPT" if architecture == MPT_ARCHITECTURE else architecture
    what = "custom code; trust_remote_code=True" if custom else f"{mpt}; no custom code"
    print(f"exported {checkpoint} to {args.out} ({what}: AutoModelForCausalLM.from_pretrained({str(args.out)!r}"
          f"{', trust_remote_code=True' if custom else ''}))")  # fmt: skip
    return 0
