"""Every bad input to every ``tokbin`` subcommand: exit code 2, one line naming the file (and line or row), what was
expected and what was found, no traceback, and no output left that opens as valid."""

import gzip
import json
import shutil
import subprocess
import sys

import pytest

from tokbin import encode_files
from tokbin.cli import main
from tokbin.shards import MANIFEST

LONG_LINE_BYTES = 5000

CASES = [
    # (id, argv with {placeholders}, expected words in the one-line error)
    ("no arguments", ["encode"], ["the following arguments are required"]),
    ("unknown option", ["info", "{good_bin}", "--frobnicate"], ["unrecognized arguments"]),
    ("vocab size 0", ["train-tokenizer", "--input", "{good}", "--model-prefix", "{tmp}/m", "--vocab-size", "0"],
     ["vocab_size must be >= 4", "got 0"]),
    ("vocab too big", ["train-tokenizer", "--input", "{good}", "--model-prefix", "{tmp}/m", "--vocab-size", "100000"],
     ["m: SentencePiece training failed", "Vocabulary size too high"]),
    ("train on empty file",
     ["train-tokenizer", "--input", "{empty}", "--model-prefix", "{tmp}/m", "--vocab-size", "300"],
     ["empty.txt: empty input"]),
    ("undecodable bytes", ["encode", "--tokenizer", "{model}", "--input", "{latin}", "--output", "{out}"],
     ["latin.txt: not valid UTF-8 at byte 13 (line 2)", "expected UTF-8 text", "--errors replace"]),
    ("invalid JSON line", ["encode", "--tokenizer", "{model}", "--input", "{bad_json}", "--output", "{out}",
                           "--jsonl-field", "text"], ["bad.jsonl: line 2: expected a JSON object, found invalid JSON"]),
    ("missing field", ["encode", "--tokenizer", "{model}", "--input", "{no_field}", "--output", "{out}",
                       "--jsonl-field", "text"], ["nofield.jsonl: line 1: no field 'text'", "found keys 'body'"]),
    ("non-string field", ["encode", "--tokenizer", "{model}", "--input", "{num_field}", "--output", "{out}",
                          "--jsonl-field", "text"],
     ["num.jsonl: line 3: field 'text': expected a string, found a number"]),
    ("empty input", ["encode", "--tokenizer", "{model}", "--input", "{empty}", "--output", "{out}"],
     ["empty.txt: empty input: expected text, found 0 bytes"]),
    ("only blank lines", ["encode", "--tokenizer", "{model}", "--input", "{blank_jsonl}", "--output", "{out}",
                          "--jsonl-field", "text"], ["out.bin: no tokens to write"]),
    ("missing input", ["encode", "--tokenizer", "{model}", "--input", "{tmp}/nope.txt", "--output", "{out}"],
     ["nope.txt: no such file"]),
    ("glob without match", ["encode", "--tokenizer", "{model}", "--input", "{tmp}/*.md", "--output", "{out}"],
     ["*.md: glob matches no file"]),
    ("missing tokenizer", ["encode", "--tokenizer", "{tmp}/none.model", "--input", "{good}", "--output", "{out}"],
     ["none.model: no such file", "SentencePiece .model"]),
    ("output is an input", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{good}"],
     ["good.txt: is an input", "expected a new path"]),
    ("output is the tokenizer", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{model}"],
     ["is the tokenizer", "expected a new path"]),
    ("zero workers", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{out}", "--workers", "0"],
     ["workers must be >= 1, got 0"]),
    ("split docs of JSONL", ["encode", "--tokenizer", "{model}", "--input", "{no_field}", "--output", "{out}",
                             "--jsonl-field", "text", "--split-docs"], ["split_docs applies to plain text"]),
    *[(f"shard size {mb}", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{tmp}/s",
                            "--shard-mb", mb], [f"--shard-mb must be a finite number > 0, got {float(mb)}"])
      for mb in ("-1", "0", "inf", "nan")],
    *[(f"damaged gzip: {name}", ["encode", "--tokenizer", "{model}", "--input", f"{{{name}}}", "--output", "{out}"],
       [f"{name}.txt.gz: damaged gzip data after", reason, "expected a whole gzip file"])
      for name, reason in [("truncated", "Compressed file ended before the end-of-stream marker"),
                           ("bad_crc", "CRC check failed"), ("bad_deflate", "Error -3 while decompressing"),
                           ("not_gzip", "Not a gzipped file")]],
    ("long lines", ["train-tokenizer", "--input", "{long}", "--model-prefix", "{tmp}/m", "--vocab-size", "300"],
     ["m: SentencePiece training failed: no line of", "long.txt fits max_sentence_length (4192 bytes; the longest is "
      f"{LONG_LINE_BYTES})", "--max-sentence-length"]),
    ("only blank lines to train on", ["train-tokenizer", "--input", "{blank_lines}", "--model-prefix", "{tmp}/m",
                                      "--vocab-size", "300"], ["blank_lines.txt to train on", "only empty lines"]),
    ("only spaces to train on", ["train-tokenizer", "--input", "{spaces}", "--model-prefix", "{tmp}/m",
                                 "--vocab-size", "300"], ["spaces.txt to train on", "only spaces"]),
    ("max sentence length 0", ["train-tokenizer", "--input", "{good}", "--model-prefix", "{tmp}/m", "--vocab-size",
                               "300", "--max-sentence-length", "0"], ["--max-sentence-length must be >= 1, got 0"]),
    ("manifest without its last shard", ["info", "{without_last}"],
     ["without_last/manifest.json: the last shard listed ends at", "not at the end of the 1 inputs",
      "expected every shard the encode wrote listed"]),
    ("manifest without its first shard", ["info", "{without_first}"],
     ["without_first/manifest.json: shards[0] is 'shard-00001.bin': expected 'shard-00000.bin'"]),
    ("manifest total edited", ["info", "{total_edited}"],
     ["total_edited/manifest.json: n_tokens: the manifest says 1000, its ", " shards hold"]),
    ("manifest total of the wrong type", ["info", "{total_typed}"],
     ["total_typed/manifest.json: n_docs: expected the total as an int >= 0, found 'many'"]),
    ("shard checksum mismatch", ["verify", "{damaged}", "--quiet"],
     ["shard-00001.bin: data checksum mismatch", "expected sha256"]),
    ("shard of another encode", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{damaged}",
                                 "--shard-mb", "0.02"], ["holds shards of another encode", "inputs", "differ"]),
    ("foreign token file", ["info", "{foreign}"], ["foreign.bin: not a tokbin file: expected magic"]),
    ("missing token file", ["info", "{tmp}/nope.bin"], ["nope.bin: no such file"]),
    ("wrong tokenizer", ["verify", "{good_bin}", "--tokenizer", "{other}", "--quiet"],
     ["good.bin: tokenizer mismatch", "other.model"]),
    ("piece of a terabyte", ["encode", "--tokenizer", "{model}", "--input", "{good}", "--output", "{out}",
                             "--piece-kb", str(2**40)], ["--piece-kb must be in [1, 1048576]", f"got {2**40}"]),
    *[(f"stats bucket {b}", ["stats", "{good_bin}", "--buckets", "256", b],
       [f"buckets: expected lengths in tokens >= 1, got {b}"]) for b in ("-5", "0")],
]  # fmt: skip
ZSTD_CASES = [
    *[(f"damaged zstd: {name}", ["encode", "--tokenizer", "{model}", "--input", f"{{{name}}}", "--output", "{out}"],
       [f"{name}.txt.zst: damaged zstd data after", "expected a whole zstd file"])
      for name in ("truncated_zst", "header_zst")],
]  # fmt: skip
PARQUET_CASES = [
    ("missing Parquet column", ["encode", "--tokenizer", "{model}", "--input", "{parquet}", "--output", "{out}",
                                "--parquet-column", "text"], ["t.parquet: no column 'text'", "found columns ['body']"]),
    ("null Parquet value", ["encode", "--tokenizer", "{model}", "--input", "{parquet}", "--output", "{out}",
                            "--parquet-column", "body"], ["t.parquet: row 2: column 'body': expected a string"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory, lossless_model, other_model, corpus):
    tmp = tmp_path_factory.mktemp("bad")
    paths = {"tmp": tmp, "model": lossless_model, "other": other_model, "out": tmp / "out.bin"}

    def put(name, data):
        path = tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
        paths[name.split(".")[0].replace("-", "_")] = path
        return path

    paths["good"] = put("good.txt", corpus.read_text(encoding="utf-8")[:20_000])
    packed = gzip.compress(corpus.read_bytes(), mtime=0)
    put("truncated.txt.gz", packed[: len(packed) // 2])
    put("bad_crc.txt.gz", packed[:-8] + bytes(b ^ 0xFF for b in packed[-8:-4]) + packed[-4:])
    put("bad_deflate.txt.gz", packed[:10] + bytes([packed[10] ^ 0xFF]) + packed[11:])
    put("not_gzip.txt.gz", "plain text\n")
    put("long.txt", ("x" * LONG_LINE_BYTES + "\n") * 3)
    put("blank_lines.txt", "\n\n\n")
    put("spaces.txt", "  \n \n")
    put("latin.txt", b"good line\ncaf\xe9\n")
    paths["bad_json"] = put("bad.jsonl", '{"text": "fine"}\n{"text": oops}\n')
    paths["no_field"] = put("nofield.jsonl", '{"body": "x"}\n')
    paths["num_field"] = put("num.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": 7}\n')
    paths["blank_jsonl"] = put("blank.jsonl", "\n \n")
    put("empty.txt", b"")
    put("foreign.bin", b"\x00" * 300)
    paths["good_bin"] = encode_files(lossless_model, [paths["good"]], tmp / "good.bin", progress=False).path
    damaged = encode_files(lossless_model, [corpus], tmp / "shards", split_docs=True, shard_bytes=50_000,
                           progress=False)  # fmt: skip
    victim = damaged.shards[1].path
    data = bytearray(victim.read_bytes())
    data[200] ^= 0xFF
    victim.write_bytes(bytes(data))
    paths["damaged"] = damaged.path
    whole = encode_files(lossless_model, [corpus], tmp / "whole", split_docs=True, shard_bytes=50_000, progress=False)
    manifest = json.loads((whole.path / MANIFEST).read_text())
    # The edits below take out the first or the last shard; how many there are depends on the corpus, which is this
    # Python's standard-library source (5 shards on 3.11, 7 on 3.12).
    assert len(manifest["shards"]) >= 3

    def edited(name, shards, **fields):
        directory = tmp / name
        shutil.copytree(whole.path, directory)
        kept = {"n_tokens": sum(s["n_tokens"] for s in shards), "n_docs": sum(s["n_docs"] for s in shards)}
        (directory / MANIFEST).write_text(json.dumps({**manifest, **kept, **fields, "shards": shards}))
        paths[name] = directory

    edited("without_last", manifest["shards"][:-1])  # the counts made consistent with the shards listed
    edited("without_first", manifest["shards"][1:])
    edited("total_edited", manifest["shards"], n_tokens=1000)
    edited("total_typed", manifest["shards"], n_docs="many")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        paths["parquet"] = tmp / "t.parquet"
        pq.write_table(pa.table({"body": ["a", None]}), paths["parquet"])
        with pa.output_stream(str(tmp / "whole.txt.zst"), compression="zstd") as f:
            f.write(corpus.read_bytes())
        packed = (tmp / "whole.txt.zst").read_bytes()
        paths["truncated_zst"] = put("truncated_zst.txt.zst", packed[: len(packed) // 2])
        paths["header_zst"] = put("header_zst.txt.zst", packed[:6] + bytes(54) + packed[60:])
    return paths


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(argv, words, files, capsys):
    _check(argv, words, files, capsys)


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in PARQUET_CASES], ids=[c[0] for c in PARQUET_CASES])
def test_bad_parquet_input_is_one_line(argv, words, files, capsys):
    if "parquet" not in files:
        pytest.skip("Parquet input needs pyarrow (the parquet extra)")
    _check(argv, words, files, capsys)


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in ZSTD_CASES], ids=[c[0] for c in ZSTD_CASES])
def test_damaged_zstd_input_is_one_line(argv, words, files, capsys):
    if "truncated_zst" not in files:
        pytest.skip("zstd input needs pyarrow (the parquet extra)")
    _check(argv, words, files, capsys)


def _check(argv, words, files, capsys):
    argv = [a.format(**files) for a in argv]
    out = files["out"]
    code, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert lines and lines[-1].startswith("tokbin") and ": error: " in lines[-1], err
    assert len([ln for ln in lines if ": error: " in ln]) == 1
    for word in words:
        assert word in lines[-1], (word, lines[-1])
    usage_error = any(w.startswith(("the following", "unrecognized")) for w in words)
    assert any(ln.startswith("usage:") for ln in lines) == usage_error, err  # a usage block only for usage errors
    assert not out.exists()  # a failed encode leaves nothing that opens as a token file


def test_console_script_prints_no_traceback(files):
    argv = ["encode", "--tokenizer", str(files["model"]), "--input", str(files["bad_json"]), "--output",
            str(files["out"]), "--jsonl-field", "text", "--workers", "2"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "tokbin.cli", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and "bad.jsonl: line 2" in errors[0]
    assert not files["out"].exists()


def test_skip_bad_lines_counts_them(files, capsys):
    argv = ["encode", "--tokenizer", str(files["model"]), "--input", str(files["num_field"]), "--output",
            str(files["tmp"] / "skip.bin"), "--jsonl-field", "text", "--skip-bad-lines", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and "skipped 1 bad lines" in out
