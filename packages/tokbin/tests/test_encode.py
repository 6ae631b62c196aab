import numpy as np
import pytest
import sentencepiece as spm

from tokbin import TokenFile, TokenFileError, clean_text, encode_files, file_sha256


@pytest.fixture(scope="module")
def sp(lossless_model):
    return spm.SentencePieceProcessor(model_file=str(lossless_model))


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


def test_workers_give_identical_files(tmp_path, lossless_model, corpus, wiki_text):
    a = encode_files(lossless_model, [corpus, wiki_text], tmp_path / "w1.bin", workers=1, progress=False)
    b = encode_files(lossless_model, [corpus, wiki_text], tmp_path / "w3.bin", workers=3, progress=False)
    assert a.data_sha256 == b.data_sha256
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w3.bin").read_bytes()


def test_chunk_size_does_not_change_the_tokens(tmp_path, lossless_model, wiki_text, monkeypatch):
    import tokbin.encode

    whole = encode_files(lossless_model, [wiki_text], tmp_path / "a.bin", split_docs=True, progress=False)
    monkeypatch.setattr(tokbin.encode, "_CHUNK_CHARS", 1000)  # many batched calls instead of one
    chunked = encode_files(lossless_model, [wiki_text], tmp_path / "b.bin", split_docs=True, progress=False)
    assert whole.n_docs > 20
    assert chunked.data_sha256 == whole.data_sha256


def test_split_docs_and_eos(tmp_path, lossless_model, sp):
    src = tmp_path / "docs.txt"
    src.write_text("first doc\nstill first\n\nsecond\n \n\n\nthird\n", encoding="utf-8")
    tf = encode_files(lossless_model, [src], tmp_path / "s.bin", split_docs=True, progress=False)
    assert tf.n_docs == 3
    texts = [sp.decode(tf.document(i)[:-1].tolist()) for i in range(3)]
    assert texts == ["first doc\nstill first", "second", "third\n"]
    assert all(tf.document(i)[-1] == sp.eos_id() for i in range(3))
    no_eos = encode_files(lossless_model, [src], tmp_path / "n.bin", split_docs=True, eos=False, progress=False)
    assert no_eos.eos_id is None and no_eos.n_tokens == tf.n_tokens - 3
    assert sp.eos_id() not in np.asarray(no_eos.tokens)


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


def test_non_utf8_input_names_the_file(tmp_path, lossless_model):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(TokenFileError, match=r"latin1.txt: not valid UTF-8 at byte 3") as e:
        encode_files(lossless_model, [bad], tmp_path / "x.bin", progress=False)
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


def test_token_file_opens_after_encode(tmp_path, lossless_model, corpus):
    encode_files(lossless_model, [corpus], tmp_path / "o.bin", progress=False)
    assert TokenFile(tmp_path / "o.bin").vocab_size == 500
