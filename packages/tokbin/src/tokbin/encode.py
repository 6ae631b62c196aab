"""Streaming, parallel, deterministic encoding of text, JSONL or Parquet inputs into a token file or a shard directory.

The main process reads pieces (``tokbin.sources``), worker processes encode them (``tokbin.documents``), and the
main process writes the results in input order: memory holds a few pieces per worker, never a file, and the output
is byte-identical for any worker count and piece size. A shard directory resumes after its last finished shard.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokbin.bar import Bar
from tokbin.documents import ERRORS, DocOptions, HashSplit, Part, PieceResult, crc32_combine, encode_piece
from tokbin.errors import TokenFileError
from tokbin.fileformat import dtype_for_vocab
from tokbin.shards import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, ShardedTokens, shard_name, write_manifest
from tokbin.sources import PIECE_BYTES, Piece, Position, ReadOptions, compression, expand_inputs, read_pieces
from tokbin.text_tokenizer import Tokenizer, load_tokenizer
from tokbin.tokenfile import TokenFile
from tokbin.writer import TokenWriter, exclusive_lock

__all__ = ["ERRORS", "EncodeResult", "HashSplit", "default_workers", "encode_files", "encode_inputs"]


def default_workers() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class EncodeResult:
    """What an encode wrote: the token file or shard directory (opened), and what it read."""

    tokens: TokenFile | ShardedTokens
    skipped_lines: int = 0  # bad JSONL lines or Parquet rows skipped under skip_bad_lines
    text_bytes: int = 0  # UTF-8 bytes of the documents encoded
    resumed_shards: int = 0  # finished shards of an earlier, interrupted run that were kept


# ---- worker processes -------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tok: Tokenizer, opts: DocOptions, dtype: str, parent: int) -> None:
    # one thread per worker, as for SentencePiece: the workers are the parallelism (tokenizers reads this per call)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=tok, opts=opts, dtype=np.dtype(dtype))
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _heap_trimmer():
    """glibc's malloc_trim(0), or a no-op elsewhere.

    Encoding a piece allocates and frees arrays of every size; glibc keeps the freed heap and, as its mmap threshold
    rises, serves later large arrays from it too, so a process that encodes gigabytes grows by fragmentation
    (measured: a worker 58 -> 73 MB over 600 MB of text, still rising). Trimming after each piece keeps it flat
    (56-58 MB) at no measurable cost (about one call per megabyte of text).
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


_trim_heap = _heap_trimmer()


def _exit_with_parent(parent: int) -> None:
    # a parent killed by SIGKILL cannot stop its pool: each worker leaves on its own once it is orphaned
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode_in_worker(piece: Piece) -> PieceResult:
    result = encode_piece(_WORKER["tok"], piece, _WORKER["opts"], _WORKER["dtype"])
    _trim_heap()
    return result


def _encoded(pieces: Iterator[Piece], tok: Tokenizer, opts: DocOptions, dtype: np.dtype, workers: int):
    """(piece, result) in input order; with several workers at most 2 pieces per worker are in flight."""
    if workers == 1:
        for piece in pieces:
            result = encode_piece(tok, piece, opts, dtype)
            _trim_heap()
            yield piece, result
        return
    # fork where there is one: spawn would re-import the caller's main module, which breaks scripts without a
    # `__main__` guard; the children run only the tokenizer and numpy, no lock a parent thread could hold. Under
    # spawn the tokenizer travels pickled as its serialized form (the .model bytes, the tokenizer.json text).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with _parallelism_configured():
        pool = ctx.Pool(workers, _init_worker, (tok, opts, dtype.str, os.getpid()))
    try:
        in_flight: deque = deque()
        for piece in pieces:
            in_flight.append((piece, pool.apply_async(_encode_in_worker, (piece,))))
            if len(in_flight) >= 2 * workers:
                done, result = in_flight.popleft()
                yield done, result.get()
        while in_flight:
            done, result = in_flight.popleft()
            yield done, result.get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


@contextlib.contextmanager
def _parallelism_configured():
    """TOKENIZERS_PARALLELISM set while the pool forks: tokenizers warns in every child forked after its threads ran
    in the parent unless the variable is set (each worker sets it to false for itself anyway)."""
    preset = "TOKENIZERS_PARALLELISM" in os.environ
    if not preset:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if not preset:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


@dataclass
class _Job:
    """What every piece of one encode shares: the inputs and how to read, cut and encode them."""

    paths: list[Path]
    read_opts: ReadOptions
    doc_opts: DocOptions
    tok: Tokenizer
    workers: int
    dtype: np.dtype
    parquet_column: str | None
    bar: Bar

    def results(self, start: Position | None = None) -> Iterator[tuple[Piece, PieceResult]]:
        pieces = read_pieces(self.paths, self.read_opts, start or Position(), parquet_column=self.parquet_column)
        for piece, result in _encoded(pieces, self.tok, self.doc_opts, self.dtype, self.workers):
            self.bar.update(piece.n_bytes)
            yield piece, result


# ---- assembling documents ---------------------------------------------------------------------------------------


@dataclass
class _Assembler:
    """Writes piece results in order; under a hash split it holds a document that spans pieces until it ends."""

    hash_split: HashSplit | None
    text_bytes: int = 0
    skipped_lines: int = 0
    pending: list[Part] = field(default_factory=list)
    crc: int = 0
    n_bytes: int = 0

    def feed(self, w: TokenWriter, r: PieceResult) -> None:
        self.skipped_lines += r.bad_lines
        if r.head is not None:
            self._part(w, r.head)
        if r.body_lengths.size:
            w.write_documents(r.body, r.body_lengths)
            self.text_bytes += r.body_bytes
        if r.tail is not None:
            self._part(w, r.tail)

    def _part(self, w: TokenWriter, part: Part) -> None:
        if self.hash_split is None:
            w.write(part.ids)
            self.text_bytes += part.n_bytes
            if part.closed:
                w.end_document()
            return
        if not part.closed and not part.n_bytes and not self.pending:
            return  # a piece that ends right at a document's end opens an empty one: nothing to hold yet
        self.crc = crc32_combine(self.crc, part.crc, part.n_bytes) if self.pending else part.crc
        self.n_bytes = self.n_bytes + part.n_bytes if self.pending else part.n_bytes
        self.pending.append(part)
        if part.closed:
            if self.hash_split.keeps(self.crc, self.n_bytes):
                for p in self.pending:
                    w.write(p.ids)
                w.end_document()
                self.text_bytes += self.n_bytes
            self.pending = []

    @property
    def in_document(self) -> bool:
        return bool(self.pending)


# ---- the entry points -------------------------------------------------------------------------------------------


def encode_inputs(
    tokenizer: str | os.PathLike | Tokenizer,
    inputs: list[str | os.PathLike],
    output: str | os.PathLike,
    *,
    workers: int | None = None,
    eos: bool = True,
    split_docs: bool = False,
    clean: bool = False,
    progress: bool = True,
    errors: str = "strict",
    jsonl_field: str | None = None,
    parquet_column: str | None = None,
    skip_bad_lines: bool = False,
    shard_bytes: int | None = None,
    piece_bytes: int = PIECE_BYTES,
    hash_split: HashSplit | None = None,
) -> EncodeResult:
    """``encode_files`` with a report: see there. Returns the opened output and what was read."""
    if errors not in ERRORS:
        raise ValueError(f"errors must be one of {ERRORS}, got {errors!r}")
    if jsonl_field is not None and parquet_column is not None:
        raise ValueError("jsonl_field and parquet_column: expected at most one input format, got both")
    fmt = "jsonl" if jsonl_field is not None else "parquet" if parquet_column is not None else "text"
    if split_docs and fmt != "text":
        raise ValueError(f"split_docs applies to plain text; in {fmt} input every line or row is a document")
    if not inputs:
        raise ValueError("inputs: expected at least one input file, got none")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    # more processes than CPUs cannot encode faster (the output is the same for any count), and thousands of them
    # took longer to start than any input takes to encode
    workers = default_workers() if workers is None else min(workers, default_workers())
    tok = load_tokenizer(tokenizer)
    # SentencePiece encodes line by line; a Hugging Face tokenizer sees whole documents (see tokbin.documents), or
    # pieces of them cut where its ids cannot tell (a line end between printable bytes), so memory stays bounded
    hf = tok.kind != "sentencepiece"
    whole = hf and not getattr(tok, "cuts_at_line_ends", False)
    read_opts = ReadOptions(fmt, split_docs, clean, piece_bytes, shard_bytes, whole_documents=whole,
                            printable_after_cut=hf)  # fmt: skip
    eos_id = tok.eos_id if eos else None
    if eos and eos_id is None:
        raise TokenFileError(
            tok.path or tokenizer, "tokenizer has no EOS token: expected one for eos=True (or pass eos=False)"
        )
    paths = expand_inputs(inputs, fmt)
    out = Path(output)
    _check_output(out, paths, tok.path, sharded=shard_bytes is not None)
    field_name = jsonl_field or parquet_column
    doc_opts = DocOptions(fmt, split_docs, clean, errors, field_name, skip_bad_lines, eos_id, hash_split)
    vocab, sha = tok.vocab_size, tok.sha256
    dtype = dtype_for_vocab(vocab)
    total = None if any(compression(p) for p in paths) else sum(p.stat().st_size for p in paths)
    bar = Bar(total=total, unit="B", unit_scale=True, desc="encode", disable=not progress)
    job = _Job(paths, read_opts, doc_opts, tok, workers, dtype, parquet_column, bar)
    try:
        if shard_bytes is None:
            asm = _Assembler(hash_split)
            with TokenWriter(out, vocab_size=vocab, eos_id=eos_id, tokenizer_sha256=sha) as w:
                for _, result in job.results():
                    asm.feed(w, result)
            assert w.token_file is not None  # opened when the with block ended without an exception
            return EncodeResult(w.token_file, asm.skipped_lines, asm.text_bytes)
        fingerprint = {
            "inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
            "format": fmt,
            "field": jsonl_field or parquet_column,
            "split_docs": split_docs,
            "clean": clean,
            "errors": errors,
            "eos": eos,
            "skip_bad_lines": skip_bad_lines,
            "shard_bytes": shard_bytes,
            "hash_split": None if hash_split is None else [hash_split.fraction, hash_split.part],
        }
        header = {"vocab_size": vocab, "eos_id": eos_id, "tokenizer_sha256": sha, "dtype": dtype.name}
        return _encode_shards(out, job, fingerprint, header)
    finally:
        bar.close()


def _check_output(out: Path, paths: list[Path], tokenizer: Path | None, *, sharded: bool) -> None:
    target = out.resolve()
    for p in [*paths, *([] if tokenizer is None else [tokenizer])]:
        src = p.resolve()
        if src == target or (sharded and src.is_relative_to(target)):
            what = "the tokenizer" if p == tokenizer else "an input"
            raise TokenFileError(out, f"is {what} ({p}): expected a new path for the output")
    if not sharded and out.is_dir():
        raise TokenFileError(out, "is a directory: expected a token file path (or pass shard_bytes for shards)")
    if sharded and out.exists() and not out.is_dir():
        raise TokenFileError(out, "is a file: expected a directory for shards")


def _encode_shards(out: Path, job: _Job, fingerprint: dict, header: dict) -> EncodeResult:
    if not out.parent.is_dir():
        raise TokenFileError(out, f"output directory {out.parent} does not exist")
    out.mkdir(exist_ok=True)
    with exclusive_lock(out / MANIFEST):
        kept = _finished_shards(out, fingerprint, header["tokenizer_sha256"])
        n_kept = len(kept)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "complete": False,
            **header,
            "encode": fingerprint,
            "shards": list(kept),
        }
        start = Position(*kept[-1]["end"]) if kept else Position()
        if start.input < len(job.paths):
            _clear_unlisted(out, kept)
            write_manifest(out, manifest)
            _write_shards(out, job, manifest, start)
        manifest["complete"] = True
        manifest["n_tokens"] = sum(s["n_tokens"] for s in manifest["shards"])
        manifest["n_docs"] = sum(s["n_docs"] for s in manifest["shards"])
        write_manifest(out, manifest)
    return EncodeResult(
        ShardedTokens(out),
        sum(s["skipped_lines"] for s in manifest["shards"]),
        sum(s["text_bytes"] for s in manifest["shards"]),
        n_kept,
    )


def _finished_shards(out: Path, fingerprint: dict, tokenizer_sha256: str) -> list[dict]:
    """The leading shards of an earlier run of the same encode whose data checksums still match."""
    from tokbin.shards import read_manifest

    if not (out / MANIFEST).exists():
        if any(out.iterdir()) and not all(p.name == MANIFEST + ".lock" for p in out.iterdir()):
            raise TokenFileError(out, "directory holds files but no manifest: expected an empty or shard directory")
        return []
    manifest = read_manifest(out)
    if manifest.get("encode") != fingerprint:
        old = manifest.get("encode") or {}
        differs = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        raise TokenFileError(
            out,
            f"holds shards of another encode ({', '.join(differs)} differ): expected the same inputs and options "
            "to resume; remove the directory or choose another output",
        )
    if manifest.get("tokenizer_sha256") != tokenizer_sha256:
        raise TokenFileError(
            out,
            f"holds shards encoded with tokenizer sha256 {manifest.get('tokenizer_sha256')}, not {tokenizer_sha256}: "
            "expected the same tokenizer to resume; remove the directory or choose another output",
        )
    kept = []
    for entry in manifest["shards"]:
        try:
            tf = TokenFile(out / entry["file"])
            tf.verify()
        except TokenFileError:
            break  # damaged or missing: encode again from here
        if tf.data_sha256 != entry.get("data_sha256"):
            break
        kept.append(entry)
    return kept


def _clear_unlisted(out: Path, kept: list[dict]) -> None:
    names = {e["file"] for e in kept}
    for p in out.iterdir():
        stale_shard = p.name.startswith("shard-") and p.name.endswith(".bin") and p.name not in names
        temp = p.name.startswith(".") and p.name.endswith(".tmp")
        if stale_shard or temp:
            p.unlink()


def _write_shards(out: Path, job: _Job, manifest: dict, start: Position) -> None:
    asm = _Assembler(job.doc_opts.hash_split)
    n_inputs = len(job.paths)
    stack = contextlib.ExitStack()
    w: TokenWriter | None = None

    def close_shard(shard: TokenWriter, end: Position) -> None:
        stack.close()
        assert shard.token_file is not None  # opened when the stack closed the writer without an exception
        manifest["shards"].append(
            {
                "file": shard.path.name,
                "n_tokens": shard.n_tokens,
                "n_docs": shard.n_docs,
                "data_sha256": shard.token_file.data_sha256,
                "end": [end.input, end.offset, end.line],
                "skipped_lines": asm.skipped_lines,
                "text_bytes": asm.text_bytes,
            }
        )
        write_manifest(out, manifest)
        asm.skipped_lines = asm.text_bytes = 0

    with stack:
        for piece, result in job.results(start):
            if w is None:
                name = out / shard_name(len(manifest["shards"]))
                w = stack.enter_context(
                    TokenWriter(
                        name,
                        vocab_size=manifest["vocab_size"],
                        eos_id=manifest["eos_id"],
                        tokenizer_sha256=manifest["tokenizer_sha256"],
                        lock=False,
                    )
                )
            asm.feed(w, result)
            # a shard that is still empty (every document held out, say) runs on to the next boundary
            if (piece.shard_end or piece.end().input == n_inputs) and w.n_tokens and not asm.in_document:
                close_shard(w, piece.end())
                w = None
        if w is not None:
            if w.n_tokens:
                close_shard(w, Position(n_inputs, 0, 1))
            else:
                w.discard()
                if manifest["shards"]:  # what followed the last shard was all held out: it ends the input too
                    manifest["shards"][-1]["end"] = [n_inputs, 0, 1]
    if not manifest["shards"]:
        raise TokenFileError(out, "no tokens to write: expected at least one id, found empty input")


def encode_files(
    tokenizer: str | os.PathLike | Tokenizer,
    inputs: list[str | os.PathLike],
    output: str | os.PathLike,
    **options: Any,
) -> TokenFile | ShardedTokens:
    """Encode inputs with a tokenizer into the token file (or shard directory) ``output`` and open it.

    ``tokenizer``: a SentencePiece ``.model``, a Hugging Face model directory (its tokenizer.json; the ``hf``
    extra) or a :class:`tokbin.text_tokenizer.Tokenizer` (see ``load_tokenizer``). The header records its
    ``sha256``, vocabulary size (uint32 ids above 65536) and EOS id. SentencePiece encodes line by line, as always;
    a Hugging Face tokenizer's ids equal ``tokenizers``' own encode of each document: pieces end at a line end
    between printable non-space ASCII bytes where its ids cannot tell the cut (``HFTokenizer.cuts_at_line_ends``:
    byte-level BPEs such as GPT-2's, Llama 3's and Qwen2's), and only at document ends otherwise (a Metaspace
    tokenizer's plain-text file without ``split_docs`` is then read whole).

    ``inputs`` are files, directories (their files, recursively, sorted) or globs, read in that order and in pieces
    of ``piece_bytes`` (memory does not grow with the input). Formats: plain UTF-8 text (a document is a file, or
    with ``split_docs`` each blank-line-separated block), JSONL (``jsonl_field="text"``: a document per line) or
    Parquet (``parquet_column="text"``: a document per row; needs pyarrow); ``.gz`` inputs are decompressed, and
    ``.zst`` ones through pyarrow. An EOS id follows every document unless ``eos=False``.

    ``workers`` processes (default: all CPUs, and never more) encode pieces in parallel; the output is
    byte-identical for any worker count and piece size. ``shard_bytes`` writes a directory of shards, each ending
    at the first document end after that many input bytes, with a manifest; run again after an interruption, it
    keeps the finished shards (checked by checksum) and encodes the rest. ``clean`` strips HTML tags, citation
    marks and whitespace runs first.
    ``errors`` handles undecodable bytes: "strict" (raise, naming the file, byte and line), "replace", "ignore".
    A bad JSONL line or Parquet value raises, naming the file and line, unless ``skip_bad_lines``.
    ``hash_split`` keeps only one part of a held-out split by document hash (see ``HashSplit``).

    Example::

        tf = encode_files("spm.model", ["a.txt", "b.txt"], "train.bin", workers=2)
        tf.n_docs  # 2
        ds = encode_files("spm.model", ["web/"], "web_shards", jsonl_field="text", shard_bytes=1 << 30)
    """
    return encode_inputs(tokenizer, inputs, output, **options).tokens
