"""`lmtrain prepare`: formats, the held-out split by document hash, meta.json's paths, and one-line errors."""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tokbin
from lmtrain.cli import main
from lmtrain.corpus import build_corpus
from lmtrain.errors import LmtrainError
from lmtrain.run_files import read_meta

VOCAB = "512"


def stdlib_text(n_bytes: int) -> str:
    """About ``n_bytes`` of standard-library source (the demo's corpus)."""
    path = Path(tempfile.mkdtemp()) / "stdlib.txt"
    build_corpus(path, 2 * n_bytes)  # stops near its target, not past it: ask for twice what is kept
    text = path.read_text(encoding="utf-8")
    shutil.rmtree(path.parent)
    return text[:n_bytes]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(stdlib_text(120_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "data"
    assert main(["prepare", "--text", str(corpus), "--out", str(out), "--vocab-size", VOCAB, "--quiet"]) == 0
    return out


def test_text_prepare_holds_out_documents_by_hash(prepared, corpus):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["split"] == {"by": "document hash", "val_fraction": 0.1}
    assert meta["tokenizer"] == "tokenizer.model" and meta["train"]["file"] == "train.bin"
    train, val = tokbin.TokenFile(prepared / "train.bin"), tokbin.TokenFile(prepared / "val.bin")
    whole = tokbin.encode_files(prepared / "tokenizer.model", [corpus], prepared.parent / "all.bin", split_docs=True,
                                progress=False)  # fmt: skip
    assert train.n_docs + val.n_docs == whole.n_docs and train.n_tokens + val.n_tokens == whole.n_tokens
    assert 0.03 < val.n_docs / whole.n_docs < 0.2
    assert meta["train"]["tokens"] == train.n_tokens and meta["val"]["documents"] == val.n_docs
    assert 0 < meta["tokenizer_sample_bytes"] <= corpus.stat().st_size
    assert not (prepared / ".tokenizer_sample.txt").exists()
    # val.txt: the start of the held-out documents, decoded exactly (the tokenizer is lossless)
    first = (prepared / "val.txt").read_text(encoding="utf-8").split("\n\n")[0]
    assert first and first in corpus.read_text(encoding="utf-8")
    loaded = read_meta(prepared)
    assert Path(loaded["train_path"]) == prepared / "train.bin"


def test_same_corpus_same_split(prepared, corpus, tmp_path):
    again = tmp_path / "again"
    assert main(["prepare", "--text", str(corpus), "--out", str(again), "--vocab-size", VOCAB, "--quiet",
                 "--workers", "1"]) == 0  # fmt: skip
    import sentencepiece as spm

    pieces = [spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")) for d in (again, prepared)]
    assert [pieces[0].id_to_piece(i) for i in range(512)] == [pieces[1].id_to_piece(i) for i in range(512)]
    for name in ("train.bin", "val.bin"):  # the model files differ only in the paths SentencePiece records
        a, b = tokbin.TokenFile(again / name), tokbin.TokenFile(prepared / name)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.doc_offsets, b.doc_offsets)


def test_jsonl_and_shards(corpus, tmp_path):
    docs = [d for d in corpus.read_text(encoding="utf-8").split("\n\n\n") if d.strip()]
    src = tmp_path / "docs.jsonl.gz"
    import gzip

    src.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    out = tmp_path / "data"
    args = ["prepare", "--text", str(src), "--jsonl-field", "text", "--out", str(out), "--vocab-size", VOCAB,
            "--shard-mb", "0.03", "--val-fraction", "0.2", "--quiet"]  # fmt: skip
    assert main(args) == 0
    meta = read_meta(out)
    train, val = tokbin.open_tokens(meta["train_path"]), tokbin.open_tokens(meta["val_path"])
    assert isinstance(train, tokbin.ShardedTokens) and len(train.shards) > 1
    assert train.n_docs + val.n_docs == len(docs)
    assert main(args) == 0  # a rerun finds every shard finished and keeps it


def test_val_text_keeps_files_as_documents(corpus, tmp_path):
    val = tmp_path / "val.txt"
    val.write_text(stdlib_text(200_000)[150_000:], encoding="utf-8")
    out = tmp_path / "data"
    assert main(["prepare", "--text", str(corpus), "--val-text", str(val), "--out", str(out), "--vocab-size", VOCAB,
                 "--quiet"]) == 0  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    assert meta["split"] == {"by": "files"}
    assert meta["train"]["documents"] == 1 and meta["train"]["bytes"] == corpus.stat().st_size
    assert meta["val"]["bytes"] == val.stat().st_size


def test_read_meta_rejects_escaping_paths_and_another_tokenizer(prepared, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    meta = json.loads((data / "meta.json").read_text())
    for key, value in [("tokenizer", "../tokenizer.model"), ("tokenizer", "/etc/passwd")]:
        (data / "meta.json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(LmtrainError, match="leaves the data directory"):
            read_meta(data)
    (data / "meta.json").write_text(json.dumps({**meta, "train": {**meta["train"], "file": "../../x.bin"}}))
    with pytest.raises(LmtrainError, match="train file '../../x.bin' leaves the data directory"):
        read_meta(data)
    (data / "meta.json").write_text(json.dumps(meta))
    other = tokbin.train_tokenizer([data / "val.txt"], tmp_path / "other", 400, minloglevel=2)
    shutil.copy(other, data / "tokenizer.model")
    with pytest.raises(LmtrainError, match=r"train.bin: encoded with a tokenizer of sha256 .* expected the same"):
        read_meta(data)


def _parquet_dir(directory: Path) -> Path:
    directory.mkdir()
    (directory / "rows.parquet").write_bytes(b"PAR1")
    return directory


def _files(tmp_path: Path) -> dict:
    def put(name: str, data: bytes) -> Path:
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    return {
        "tmp": tmp_path,
        "latin": put("latin.txt", b"fine\n\ncaf\xe9\n"),
        "bad_json": put("bad.jsonl", b'{"text": "a"}\n{oops\n'),
        "no_field": put("nofield.jsonl", b'{"body": "a"}\n'),
        "num_field": put("num.jsonl", b'{"text": 3}\n'),
        "empty": put("empty.txt", b""),
        "jsonl": put("docs.jsonl", b'{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n'),
        "rows": _parquet_dir(tmp_path / "rows"),
        "one": put("one.txt", "\n".join(ln for ln in stdlib_text(20_000).splitlines() if ln.strip()).encode()),
    }


CASES = [
    (["--vocab-size", "0"], ["--vocab-size must be >= 4", "got 0"]),
    (["--val-fraction", "1.5"], ["--val-fraction must be in (0, 1), got 1.5"]),
    (["--tokenizer-sample-mb", "0"], ["--tokenizer-sample-mb must be a finite number > 0"]),
    (["--text", "{tmp}/missing.txt"], ["missing.txt: no such file"]),
    (["--text", "{latin}"], ["latin.txt: not valid UTF-8 at byte 9 (line 3)"]),
    (["--text", "{bad_json}", "--jsonl-field", "text"], ["bad.jsonl: line 2: expected a JSON object"]),
    (["--text", "{no_field}", "--jsonl-field", "text"], ["nofield.jsonl: line 1: no field 'text'"]),
    (["--text", "{num_field}", "--jsonl-field", "text"], ["num.jsonl: line 1: field 'text': expected a string"]),
    (["--text", "{empty}"], ["empty.txt: empty input"]),
    (["--text", "{one}"], ["--val-fraction 0.1 left a split without documents"]),
    (["--text", "{jsonl}"], ["docs.jsonl: looks like JSONL", "fields id, text", "add --jsonl-field text"]),
    (["--text", "{corpus}", "--val-text", "{jsonl}"], ["--val-text", "docs.jsonl: looks like JSONL"]),
    (["--text", "{rows}"], ["rows.parquet: looks like Parquet", "--parquet-column COLUMN"]),
    (["--text", "{tmp}/*.parquet", "--parquet-column", "text"], ["glob matches no file"]),
]


@pytest.mark.parametrize(("extra", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line(extra, words, corpus, tmp_path, capsys):
    files = {**_files(tmp_path), "corpus": corpus}
    argv = ["prepare", "--text", str(corpus), "--out", str(tmp_path / "out"), "--vocab-size", VOCAB, "--quiet"]
    argv += [a.format(**files) for a in extra]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("lmtrain prepare: error: "), err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "out").exists()  # nothing left behind, late failures included


def test_missing_pyarrow_names_the_checkout_directory_once(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed: the missing-extra line cannot show")
    from trainloop.extras import install_hint

    rows = _parquet_dir(tmp_path / "rows")
    code = main(["prepare", "--text", str(rows), "--parquet-column", "text", "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    hint = install_hint("parquet", "lmtools-tokbin")
    assert code == 2 and err.endswith(f"needs pyarrow: {hint}") and err.count("pip install") == 1, err
    assert not (tmp_path / "out").exists()


def test_prepare_with_a_runs_tokenizer_continues_that_run_on_new_data(tmp_path, capsys):
    import tokbin
    from lmtrain.cli import main
    from lmtrain.corpus import build_corpus
    from lmtrain.examples import tiny_run

    (tmp_path / "first").mkdir()
    run = tiny_run(tmp_path / "first")
    new = tmp_path / "new.txt"
    build_corpus(new, 60_000)
    assert main(["prepare", "--text", str(new), "--out", str(tmp_path / "data2"), "--tokenizer", str(run),
                 "--quiet"]) == 0  # fmt: skip
    meta = json.loads((tmp_path / "data2" / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == tokbin.file_sha256(run / "tokenizer.model")
    assert tokbin.open_tokens(tmp_path / "data2" / "train.bin").tokenizer_sha256 == meta["tokenizer_sha256"]
    assert main(["train", "--data", str(tmp_path / "data2"), "--out", str(tmp_path / "more"), "--init-from",
                 f"{run}:latest", "--max-steps", "1", "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["prepare", "--text", str(new), "--out", str(tmp_path / "data3"), "--tokenizer",
                 str(tmp_path / "nothing")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer" in err and "no such file" in err, err
    assert not (tmp_path / "data3").exists()
