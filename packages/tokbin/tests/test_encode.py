import gzip
import itertools
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import sentencepiece as spm

from tokbin import HashSplit, TokenFile, TokenFileError, clean_text, encode_files, encode_inputs, file_sha256
from tokbin.documents import crc32_combine, split_documents


@pytest.fixture(scope="module")
def sp(lossless_model):
    return spm.SentencePieceProcessor(model_file=str(lossless_model))


def whole_text_ids(sp, paths, split_docs=False, clean=False):
    """Each input read whole and encoded at once, one call per document: the reference the pieces must match."""
    out = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        text = clean_text(text) if clean else text
        docs = split_documents(text) if split_docs else [text]
        for d in docs:
            out.extend(itertools.chain.from_iterable(sp.encode(d.splitlines(keepends=True))))
            out.append(sp.eos_id())
    return np.array(out)


def test_round_trip_with_byte_fallback(tmp_path, lossless_model, corpus, sp):
    unusual = tmp_path / "unusual.txt"
    text = "  indented\tcode()\n\n\nünïcödé → 漢字 🙂\r\nlast line without newline"
    unusual.write_bytes(text.encode("utf-8"))
    tf = encode_files(lossless_model, [corpus, unusual], tmp_path / "o.bin", progress=False)
    assert tf.n_docs == 2 and tf.tokenizer_sha256 == file_sha256(lossless_model)
    for i, src in enumerate([corpus, unusual]):
        doc = tf.document(i)
        assert doc[-1] == sp.eos_id()
        assert sp.decode(doc[:-1].tolist()) == src.read_bytes().decode("utf-8")  # \r\n kept
    assert sp.unk_id() not in np.asarray(tf.tokens)  # byte fallback: nothing became <unk>


def test_line_units_equal_whole_text_units(sp, corpus):
    # with "\n" a user-defined symbol, one call on the whole text gives the ids of the line-by-line calls
    text = corpus.read_text(encoding="utf-8")[:50_000]
    by_line = list(itertools.chain.from_iterable(sp.encode(text.splitlines(keepends=True))))
    assert sp.encode(text) == by_line


@pytest.mark.parametrize(("split_docs", "clean"), [(False, False), (True, False), (False, True), (True, True)])
def test_pieces_and_workers_give_the_whole_text_ids(tmp_path, lossless_model, corpus, wiki_text, sp, split_docs, clean):
    html = tmp_path / "html.txt"
    html.write_text("<p>Paris[1]  is\n[12,\n13] big</p>\n\n\n\nEnd [citation needed]  \n\n", encoding="utf-8")
    inputs = [corpus, wiki_text, html]
    want = whole_text_ids(sp, inputs, split_docs, clean)
    files = []
    for piece_bytes, workers in [(1 << 20, 1), (3000, 1), (3000, 2), (777, 3)]:
        out = tmp_path / f"p{piece_bytes}w{workers}.bin"
        tf = encode_files(
            lossless_model, inputs, out, workers=workers, piece_bytes=piece_bytes, split_docs=split_docs, clean=clean,
            progress=False,
        )  # fmt: skip
        assert np.array_equal(np.asarray(tf.tokens), want)
        files.append(out.read_bytes())
    assert all(f == files[0] for f in files)  # byte-identical, header and checksum included
    if split_docs:
        assert TokenFile(tmp_path / "p3000w2.bin").n_docs > 100


def test_the_worker_pool_forks_a_process_without_threads(tmp_path, lossless_model, corpus):
    # In a fresh interpreter: the threads alive when the pool forks its workers (tqdm's monitor thread did).
    script = f"""
import threading
from multiprocessing import pool
from tokbin import encode_files
seen, init = [], pool.Pool.__init__
def recording(self, *args, **kwargs):
    seen.append(sorted(t.name for t in threading.enumerate()))
    init(self, *args, **kwargs)
pool.Pool.__init__ = recording
for progress, out in ((False, "a.bin"), (True, "b.bin")):
    encode_files({str(lossless_model)!r}, [{str(corpus)!r}], {str(tmp_path)!r} + "/" + out, piece_bytes=4096,
                 workers=2, progress=progress)
print(seen)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == str([["MainThread"], ["MainThread"]]), ran.stdout


def test_a_document_longer_than_a_piece_is_one_document(tmp_path, lossless_model, corpus, sp):
    tf = encode_files(lossless_model, [corpus], tmp_path / "o.bin", piece_bytes=1024, workers=2, progress=False)
    assert corpus.stat().st_size > 100 * 1024
    assert tf.n_docs == 1 and int(np.sum(np.asarray(tf.tokens) == sp.eos_id())) == 1


def test_split_docs_and_eos(tmp_path, lossless_model, sp):
    src = tmp_path / "docs.txt"
    src.write_text("first doc\nstill first\n\nsecond\n \n\n\nthird\n", encoding="utf-8")
    tf = encode_files(lossless_model, [src], tmp_path / "s.bin", split_docs=True, progress=False)
    assert tf.n_docs == 3
    texts = [sp.decode(tf.document(i)[:-1].tolist()) for i in range(3)]
    assert texts == ["first doc\nstill first\n\n", "second\n \n\n\n", "third\n"]  # every byte kept
    assert all(tf.document(i)[-1] == sp.eos_id() for i in range(3))
    no_eos = encode_files(lossless_model, [src], tmp_path / "n.bin", split_docs=True, eos=False, progress=False)
    assert no_eos.eos_id is None and no_eos.n_tokens == tf.n_tokens - 3
    assert sp.eos_id() not in np.asarray(no_eos.tokens)


def test_split_docs_keeps_every_byte(tmp_path, lossless_model, sp, wiki_text):
    """Documents cut at blank lines, joined again, are the input: blank lines, the indentation after them and
    whitespace at either end stay in the token stream (only the EOS between documents is added)."""
    src = tmp_path / "docs.txt"
    src.write_text("\n\n  lead\n\n\n = Heading = \n \n\tindented\r\n\r\nlast  \n\n  ", encoding="utf-8")
    for path in (src, wiki_text):
        for piece_bytes in (1 << 20, 300):
            tf = encode_files(lossless_model, [path], tmp_path / "s.bin", split_docs=True, piece_bytes=piece_bytes,
                              progress=False)  # fmt: skip
            assert tf.n_docs > 1
            texts = [sp.decode(tf.document(i)[:-1].tolist()) for i in range(tf.n_docs)]
            assert "".join(texts) == path.read_bytes().decode("utf-8")  # \r\n too
            assert all(t.strip() for t in texts)
            (tmp_path / "s.bin").unlink()


def test_clean_flag(tmp_path, lossless_model, sp):
    src = tmp_path / "html.txt"
    src.write_text("<p>Paris is the <b>capital</b>[1] of   France.[12, 13]</p>\n\n\n\nEnd [citation needed]", "utf-8")
    tf = encode_files(lossless_model, [src], tmp_path / "c.bin", clean=True, progress=False)
    assert sp.decode(tf.document(0)[:-1].tolist()) == "Paris is the capital of France.\n\nEnd "
    raw = encode_files(lossless_model, [src], tmp_path / "r.bin", progress=False)
    assert "<b>" in sp.decode(raw.document(0)[:-1].tolist())  # off by default


def test_clean_text_keeps_comparisons():
    assert clean_text("if a < b and c > d:") == "if a < b and c > d:"
    # documented limit: cleaning is for prose, numeric subscripts in code read as citation marks
    assert clean_text("x[0] and y[12]") == "x and y"


def test_non_utf8_input_names_the_file_byte_and_line(tmp_path, lossless_model):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"ok\n" * 2000 + "café au lait\n".encode("latin-1"))
    with pytest.raises(TokenFileError, match=r"latin1.txt: not valid UTF-8 at byte 6003 \(line 2001\)") as e:
        encode_files(lossless_model, [bad], tmp_path / "x.bin", piece_bytes=1000, workers=2, progress=False)
    assert "expected UTF-8" in str(e.value)
    assert not (tmp_path / "x.bin").exists()
    tf = encode_files(lossless_model, [bad], tmp_path / "x.bin", progress=False, errors="replace")
    assert tf.n_tokens > 5


def test_empty_input_file(tmp_path, lossless_model, corpus):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(TokenFileError, match="empty.txt: empty input: expected text, found 0 bytes"):
        encode_files(lossless_model, [corpus, empty], tmp_path / "x.bin", progress=False)
    assert not (tmp_path / "x.bin").exists()


def test_verify_tokenizer_identity(tmp_path, lossless_model, other_model, corpus):
    tf = encode_files(lossless_model, [corpus], tmp_path / "o.bin", progress=False)
    tf.verify(lossless_model)
    with pytest.raises(TokenFileError, match="tokenizer mismatch: file was encoded with sha256") as e:
        tf.verify(other_model)
    assert str(other_model) in str(e.value)


def test_missing_tokenizer_and_input(tmp_path, lossless_model):
    with pytest.raises(TokenFileError, match="no such file"):
        encode_files(tmp_path / "none.model", [tmp_path / "a.txt"], tmp_path / "x.bin", progress=False)
    with pytest.raises(TokenFileError, match="a.txt: no such file"):
        encode_files(lossless_model, [tmp_path / "a.txt"], tmp_path / "x.bin", progress=False)


def test_output_may_not_be_an_input_or_the_tokenizer(tmp_path, lossless_model, corpus):
    copy = tmp_path / "in.txt"
    copy.write_bytes(corpus.read_bytes())
    with pytest.raises(TokenFileError, match="is an input"):
        encode_files(lossless_model, [copy], copy, progress=False)
    with pytest.raises(TokenFileError, match="is the tokenizer"):
        encode_files(lossless_model, [copy], lossless_model, progress=False)
    assert copy.read_bytes() == corpus.read_bytes()


def _jsonl(path, docs, extra_lines=()):
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs)] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_documents_match_text_documents(tmp_path, lossless_model, wiki_text, sp):
    docs = [d for d in split_documents(wiki_text.read_text(encoding="utf-8")) if d.strip()]
    src = _jsonl(tmp_path / "docs.jsonl", docs)
    want = encode_files(lossless_model, [wiki_text], tmp_path / "t.bin", split_docs=True, progress=False)
    for piece_bytes, workers in [(1 << 20, 1), (2000, 2)]:
        got = encode_files(
            lossless_model, [src], tmp_path / "j.bin", jsonl_field="text", piece_bytes=piece_bytes, workers=workers,
            progress=False,
        )  # fmt: skip
        assert got.data_sha256 == want.data_sha256 and got.n_docs == len(docs)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "line 2: expected a JSON object, found invalid JSON"),
        ('["a list"]', "line 2: expected a JSON object, found a JSON array"),
        ('{"body": "x"}', "line 2: no field 'text': expected a string there, found keys 'body'"),
        ('{"text": 42}', "line 2: field 'text': expected a string, found a number"),
        ('{"text": null}', "line 2: field 'text': expected a string, found a null"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, lossless_model, line, words):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"text": "good"}) + "\n" + line + "\n" + json.dumps({"text": "also"}) + "\n", "utf-8")
    with pytest.raises(TokenFileError, match="bad.jsonl: " + words.replace("[", r"\[")) as e:
        encode_files(lossless_model, [src], tmp_path / "x.bin", jsonl_field="text", progress=False)
    assert "--skip-bad-lines" in str(e.value)
    assert not (tmp_path / "x.bin").exists()
    result = encode_inputs(lossless_model, [src], tmp_path / "x.bin", jsonl_field="text", skip_bad_lines=True,
                           progress=False)  # fmt: skip
    assert result.skipped_lines == 1 and result.tokens.n_docs == 2


def test_gzip_input_equals_plain(tmp_path, lossless_model, corpus, wiki_text):
    gz = tmp_path / "wiki.txt.gz"
    gz.write_bytes(gzip.compress(wiki_text.read_bytes()))
    plain = encode_files(lossless_model, [corpus, wiki_text], tmp_path / "p.bin", split_docs=True, progress=False)
    packed = encode_files(lossless_model, [corpus, gz], tmp_path / "g.bin", split_docs=True, piece_bytes=5000,
                          progress=False)  # fmt: skip
    assert packed.data_sha256 == plain.data_sha256


DAMAGED_GZIP = [
    # (id, damage to a gzip file, what zlib or gzip says): one TokenFileError naming the file, for the encode and for
    # the tokenizer sample `lmtrain prepare` writes first
    ("truncated", lambda b: b[: len(b) // 2], "Compressed file ended before the end-of-stream marker"),
    ("bad CRC", lambda b: b[:-8] + bytes(x ^ 0xFF for x in b[-8:-4]) + b[-4:], "CRC check failed"),
    ("bad deflate block", lambda b: b[:10] + bytes([b[10] ^ 0xFF]) + b[11:], "Error -3 while decompressing"),
    ("not gzip", lambda b: b"plain text\n", "Not a gzipped file"),
]


@pytest.mark.parametrize(("damage", "reason"), [c[1:] for c in DAMAGED_GZIP], ids=[c[0] for c in DAMAGED_GZIP])
def test_damaged_gzip_is_one_error_naming_the_file(tmp_path, lossless_model, wiki_text, damage, reason):
    from tokbin.sample import write_sample

    gz = tmp_path / "wiki.txt.gz"
    gz.write_bytes(damage(gzip.compress(wiki_text.read_bytes(), mtime=0)))
    for run in (
        lambda: encode_files(lossless_model, [gz], tmp_path / "g.bin", piece_bytes=5000, progress=False),
        lambda: encode_files(lossless_model, [gz], tmp_path / "g", shard_bytes=20_000, progress=False),
        lambda: write_sample([gz], tmp_path / "sample.txt", 10_000, split_docs=True),
    ):
        with pytest.raises(TokenFileError, match="damaged gzip data after") as e:
            run()
        assert str(gz) in str(e.value) and reason in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "g.bin").exists()


def test_zstd_input_through_pyarrow(tmp_path, lossless_model, wiki_text):
    pa = pytest.importorskip("pyarrow", reason="zstd input is read through pyarrow (the parquet extra)")
    zst = tmp_path / "wiki.txt.zst"
    with pa.output_stream(str(zst), compression="zstd") as f:
        f.write(wiki_text.read_bytes())
    plain = encode_files(lossless_model, [wiki_text], tmp_path / "p.bin", progress=False)
    assert encode_files(lossless_model, [zst], tmp_path / "z.bin", progress=False).data_sha256 == plain.data_sha256


def test_directories_and_globs_in_sorted_order(tmp_path, lossless_model, sp):
    root = tmp_path / "in"
    (root / "b").mkdir(parents=True)
    for name, text in [("b/2.txt", "two"), ("a.txt", "one"), ("b/10.txt", "ten"), (".hidden.txt", "no")]:
        (root / name).write_text(text, encoding="utf-8")
    tf = encode_files(lossless_model, [root], tmp_path / "d.bin", progress=False)
    assert [sp.decode(tf.document(i)[:-1].tolist()) for i in range(tf.n_docs)] == ["one", "ten", "two"]
    tf = encode_files(lossless_model, [str(root / "b" / "*.txt"), root / "a.txt"], tmp_path / "g.bin", progress=False)
    assert [sp.decode(tf.document(i)[:-1].tolist()) for i in range(tf.n_docs)] == ["ten", "two", "one"]
    with pytest.raises(TokenFileError, match="glob matches no file"):
        encode_files(lossless_model, [str(root / "*.md")], tmp_path / "n.bin", progress=False)


def test_crc32_combine():
    a, b = b"held-out split " * 37, "by document hash ü".encode() * 11
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


def test_hash_split_partitions_documents_whatever_the_pieces(tmp_path, lossless_model, corpus, wiki_text, sp):
    inputs = [corpus, wiki_text]
    whole = encode_files(lossless_model, inputs, tmp_path / "all.bin", split_docs=True, progress=False)
    digests = {}
    for piece_bytes in (1 << 20, 600):
        parts = {}
        for part in ("train", "val"):
            out = tmp_path / f"{part}{piece_bytes}.bin"
            parts[part] = encode_files(
                lossless_model, inputs, out, split_docs=True, piece_bytes=piece_bytes, workers=2,
                hash_split=HashSplit(0.2, part), progress=False,
            )  # fmt: skip
            digests.setdefault(part, set()).add(parts[part].data_sha256)
        assert parts["train"].n_docs + parts["val"].n_docs == whole.n_docs
        assert parts["train"].n_tokens + parts["val"].n_tokens == whole.n_tokens
        assert 0.1 < parts["val"].n_docs / whole.n_docs < 0.3
    assert all(len(d) == 1 for d in digests.values())  # the same split for every piece size
    # each held-out document is a document of the whole encode whose key says "val"
    val = parts["val"]
    texts = {sp.decode(whole.document(i)[:-1].tolist()) for i in range(whole.n_docs)}
    for i in range(val.n_docs):
        text = sp.decode(val.document(i)[:-1].tolist())
        raw = text.encode("utf-8")
        assert text in texts and HashSplit(0.2, "val").keeps(zlib.crc32(raw), len(raw))


def test_parquet_rows_are_documents(tmp_path, lossless_model, wiki_text):
    pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow (the parquet extra)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d for d in split_documents(wiki_text.read_text(encoding="utf-8")) if d.strip()]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=50)
    want = encode_files(lossless_model, [wiki_text], tmp_path / "t.bin", split_docs=True, progress=False)
    for piece_bytes in (1 << 20, 4000):
        got = encode_files(lossless_model, [path], tmp_path / "q.bin", parquet_column="text", piece_bytes=piece_bytes,
                           workers=2, progress=False)  # fmt: skip
        assert got.data_sha256 == want.data_sha256
    with pytest.raises(TokenFileError, match=r"docs.parquet: no column 'body': expected a string column"):
        encode_files(lossless_model, [path], tmp_path / "x.bin", parquet_column="body", progress=False)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"]}), nulls)
    with pytest.raises(TokenFileError, match=r"nulls.parquet: row 2: column 'text': expected a string, found null"):
        encode_files(lossless_model, [nulls], tmp_path / "x.bin", parquet_column="text", progress=False)
    result = encode_inputs(lossless_model, [nulls], tmp_path / "x.bin", parquet_column="text", skip_bad_lines=True,
                           progress=False)  # fmt: skip
    assert result.skipped_lines == 1 and result.tokens.n_docs == 2


def test_parquet_without_pyarrow_names_the_extra(tmp_path, lossless_model):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from tokbin import encode_files, TokenFileError\n"
        "try:\n"
        f"    encode_files({str(lossless_model)!r}, [{str(tmp_path / 'x.parquet')!r}], {str(tmp_path / 'o.bin')!r},"
        " parquet_column='text', progress=False)\n"
        "except TokenFileError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    from tokbin.extras import install_hint

    assert f"needs pyarrow: {install_hint('parquet')}" in out.stdout, out.stderr
    assert "x.parquet" in out.stdout


def test_created_files_follow_the_umask(tmp_path, lossless_model, corpus):
    old = os.umask(0o022)
    try:
        tf = encode_files(lossless_model, [corpus], tmp_path / "o.bin", progress=False)
        assert (tf.path.stat().st_mode & 0o777) == 0o644
        os.umask(0o077)
        tf = encode_files(lossless_model, [corpus], tmp_path / "p.bin", progress=False)
        assert (tf.path.stat().st_mode & 0o777) == 0o600
    finally:
        os.umask(old)


def test_token_file_opens_after_encode(tmp_path, lossless_model, corpus):
    encode_files(lossless_model, [corpus], tmp_path / "o.bin", progress=False)
    assert TokenFile(tmp_path / "o.bin").vocab_size == 500


def test_install_hint_names_the_checkout_directory_pip_installed_from(monkeypatch, tmp_path):
    import json
    from importlib import metadata

    from tokbin.extras import install_hint

    checkout = tmp_path / "packages" / "tokbin"
    checkout.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    monkeypatch.chdir(tmp_path)
    for info, expected in ((None, "pip install 'lmtools-tokbin[parquet]'"),
                           ({"url": checkout.as_uri(), "dir_info": {}}, 'pip install "packages/tokbin[parquet]"'),
                           ({"url": checkout.as_uri(), "dir_info": {"editable": True}},
                            'pip install -e "packages/tokbin[parquet]"')):  # fmt: skip

        class Dist:
            def read_text(self, name, info=info):
                return None if info is None else json.dumps(info)

        monkeypatch.setattr(metadata, "distribution", lambda dist: Dist())
        assert install_hint("parquet") == expected
