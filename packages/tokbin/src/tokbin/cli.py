"""The ``tokbin`` command: train-tokenizer, encode, info, verify. Exit 0 on success, 1 with a one-line error."""

from __future__ import annotations

import argparse
import json
import sys

from tokbin.encode import ERRORS, encode_files
from tokbin.errors import TokenFileError
from tokbin.tokenfile import TokenFile
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
    t.add_argument("--threads", type=int, default=None)

    e = sub.add_parser("encode", help="encode text files into a token file")
    e.add_argument("--tokenizer", required=True, metavar="MODEL")
    e.add_argument("--input", nargs="+", required=True, metavar="FILE")
    e.add_argument("--output", required=True, metavar="OUT.bin")
    e.add_argument("--workers", type=int, default=None, metavar="N")
    e.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    e.add_argument("--split-docs", action="store_true", help="each blank-line-separated block is a document")
    e.add_argument("--clean", action="store_true", help="strip HTML tags, citation marks, whitespace runs")
    e.add_argument("--errors", choices=ERRORS, default="strict", help="undecodable UTF-8 bytes (default: fail)")

    i = sub.add_parser("info", help="print the header and counts")
    i.add_argument("file", metavar="FILE.bin")
    i.add_argument("--json", action="store_true")

    v = sub.add_parser("verify", help="check checksum, sizes, ids and tokenizer identity")
    v.add_argument("file", metavar="FILE.bin")
    v.add_argument("--tokenizer", default=None, metavar="MODEL")
    for s in (t, e, v):
        s.add_argument("--quiet", action="store_true", help="no progress bars or library logs")
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
        tf = encode_files(
            args.tokenizer,
            args.input,
            args.output,
            workers=args.workers,
            eos=not args.no_eos,
            split_docs=args.split_docs,
            clean=args.clean,
            progress=not args.quiet,
            errors=args.errors,
        )
        print(f"{tf.path}: {tf.n_tokens} tokens, {tf.n_docs} documents, {tf.dtype.name}")
    elif args.command == "info":
        info = TokenFile(args.file).info()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for k, val in info.items():
                print(f"{k:18} {val}")
    elif args.command == "verify":
        summary = TokenFile(args.file).verify(args.tokenizer, progress=not args.quiet)
        print(f"{summary['path']}: OK ({summary['n_tokens']} tokens, max id {summary['max_id']})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokbin`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except (TokenFileError, ValueError, OSError) as e:
        print(f"tokbin {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tokbin {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
