"""The ``tokbin`` command: train-tokenizer, encode, info, verify. Exit 0 on success, 2 with a one-line error."""

from __future__ import annotations

import argparse
import json
import math
import sys

from tokbin.encode import ERRORS, default_workers, encode_inputs
from tokbin.errors import TokenFileError
from tokbin.shards import open_tokens
from tokbin.sources import MAX_PIECE_BYTES, PIECE_BYTES
from tokbin.tokenizer import MODEL_TYPES, train_tokenizer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokbin", description="SentencePiece tokenization into tokbin token files.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train-tokenizer", help="train a SentencePiece model")
    t.add_argument("--input", nargs="+", required=True, metavar="FILE")
    t.add_argument("--model-prefix", required=True, metavar="PREFIX")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N")
    t.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    t.add_argument("--character-coverage", type=float, default=0.9995)
    t.add_argument("--byte-fallback", action="store_true")
    t.add_argument("--user-defined-symbols", nargs="*", default=None, metavar="SYMBOL")
    t.add_argument("--input-sentence-size", type=int, default=0, help="sample this many lines (0: all)")
    t.add_argument(
        "--max-sentence-length",
        type=int,
        default=None,
        metavar="BYTES",
        help="train on lines up to this long (SentencePiece's default: 4192; longer lines are left out)",
    )
    t.add_argument("--threads", type=int, default=None)

    e = sub.add_parser("encode", help="encode text, JSONL or Parquet inputs into a token file or shard directory")
    e.add_argument("--tokenizer", required=True, metavar="MODEL")
    e.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories (recursive) or globs; .gz, .zst"
    )
    e.add_argument("--output", required=True, metavar="OUT", help="token file, or a directory with --shard-mb")
    e.add_argument(
        "--workers", type=int, default=None, metavar="N", help="encoding processes (default and most: all CPUs)"
    )
    e.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    e.add_argument(
        "--split-docs", action="store_true", help="each blank-line-separated block is a document (blank lines kept)"
    )
    e.add_argument("--clean", action="store_true", help="strip HTML tags, citation marks, whitespace runs")
    e.add_argument("--errors", choices=ERRORS, default="strict", help="undecodable UTF-8 bytes (default: fail)")
    fmt = e.add_mutually_exclusive_group()
    fmt.add_argument("--jsonl-field", metavar="FIELD", help="inputs are JSONL: a document per line, text in FIELD")
    fmt.add_argument("--parquet-column", metavar="COLUMN", help="inputs are Parquet: a document per row (pyarrow)")
    e.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines or Parquet rows")
    e.add_argument(
        "--shard-mb",
        type=float,
        default=None,
        metavar="MB",
        help="write OUT as a directory of shards of about MB input megabytes each; rerun to resume",
    )
    e.add_argument("--piece-kb", type=int, default=PIECE_BYTES >> 10, metavar="KB", help="input per piece (memory)")

    i = sub.add_parser("info", help="print the header and counts")
    i.add_argument("file", metavar="FILE.bin|DIR")
    i.add_argument("--json", action="store_true")

    st = sub.add_parser("stats", help="document-length distribution (what the dynamic-length sampler is tuned from)")
    st.add_argument("file", metavar="FILE.bin")
    st.add_argument("--buckets", type=int, nargs="+", default=[256, 1024], help="lengths to report shares for")
    st.add_argument("--json", action="store_true")

    v = sub.add_parser("verify", help="check checksum, sizes, ids and tokenizer identity")
    v.add_argument("file", metavar="FILE.bin|DIR")
    v.add_argument("--tokenizer", default=None, metavar="MODEL")
    for s in (t, e, v):
        s.add_argument("--quiet", "--no-progress", action="store_true", help="no progress bars or library logs")
    return p


def _run(args: argparse.Namespace) -> None:
    if args.command == "train-tokenizer":
        options: dict = {}
        if args.user_defined_symbols:
            options["user_defined_symbols"] = args.user_defined_symbols
        if args.input_sentence_size:
            options.update(input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True)
        if args.threads:
            options["num_threads"] = args.threads
        if args.max_sentence_length is not None:
            if args.max_sentence_length < 1:
                raise ValueError(f"--max-sentence-length must be >= 1, got {args.max_sentence_length}")
            options["max_sentence_length"] = args.max_sentence_length
        if args.quiet:
            options["minloglevel"] = 2
        model = train_tokenizer(
            args.input,
            args.model_prefix,
            args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            progress=not args.quiet,
            **options,
        )
        print(model)
    elif args.command == "encode":
        if not 1 <= args.piece_kb <= MAX_PIECE_BYTES >> 10:
            raise ValueError(f"--piece-kb must be in [1, {MAX_PIECE_BYTES >> 10}] (every encoding process holds a "
                             f"piece in memory), got {args.piece_kb}; the default is {PIECE_BYTES >> 10}")  # fmt: skip
        if args.shard_mb is not None and not (math.isfinite(args.shard_mb) and args.shard_mb > 0):
            raise ValueError(f"--shard-mb must be a finite number > 0, got {args.shard_mb}")
        if args.workers is not None and args.workers > default_workers():
            print(
                f"tokbin encode: --workers {args.workers} capped at {default_workers()} "
                "(the CPUs this process may run on)",
                file=sys.stderr,
            )
        result = encode_inputs(
            args.tokenizer,
            args.input,
            args.output,
            workers=args.workers,
            eos=not args.no_eos,
            split_docs=args.split_docs,
            clean=args.clean,
            progress=not args.quiet,
            errors=args.errors,
            jsonl_field=args.jsonl_field,
            parquet_column=args.parquet_column,
            skip_bad_lines=args.skip_bad_lines,
            shard_bytes=None if args.shard_mb is None else max(1, int(args.shard_mb * 1e6)),
            piece_bytes=args.piece_kb << 10,
        )
        tf = result.tokens
        notes = [f"{tf.n_tokens} tokens", f"{tf.n_docs} documents", tf.dtype.name]
        if hasattr(tf, "shards"):
            notes.append(f"{len(tf.shards)} shards ({result.resumed_shards} kept from an earlier run)")
        if result.skipped_lines:
            notes.append(f"skipped {result.skipped_lines} bad lines")
        print(f"{tf.path}: {', '.join(notes)}")
    elif args.command == "info":
        info = open_tokens(args.file).info()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for k, val in info.items():
                print(f"{k:18} {val}")
    elif args.command == "stats":
        from tokbin.doc_stats import document_length_stats, format_stats

        tf = open_tokens(args.file)
        if not hasattr(tf, "doc_offsets"):
            raise ValueError(f"{args.file}: a shard directory; run `tokbin stats` on one of its shards")
        stats = document_length_stats(tf.doc_offsets, args.buckets)
        print(json.dumps(stats, indent=2) if args.json else "\n".join([f"{args.file}:", *format_stats(stats)]))
    elif args.command == "verify":
        summary = open_tokens(args.file).verify(args.tokenizer, progress=not args.quiet)
        print(f"{summary['path']}: OK ({summary['n_tokens']} tokens, max id {summary['max_id']})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokbin`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except (TokenFileError, ValueError, OSError) as e:
        print(f"tokbin {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokbin {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
