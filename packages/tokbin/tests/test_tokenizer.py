"""Tokenizer training: the same corpus gives the same model bytes anywhere, and long lines do not leave
SentencePiece without sentences."""

import subprocess
import sys

import pytest
import sentencepiece as spm
from conftest import stdlib_text

from tokbin import TokenFileError, encode_files, train_tokenizer
from tokbin.sample import SAMPLE_LINE_BYTES, split_long_lines, write_sample
from tokbin.tokenizer import portable_model

# the options lmtrain prepare trains with (lmtrain.text_codec.LOSSLESS_SPM_OPTIONS), less the sampling
LOSSLESS = dict(byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
                remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, user_defined_symbols=["\n"],
                minloglevel=2)  # fmt: skip

SAME_MODEL_CASES = [
    # (id, where and how the first model trains, the second)
    ("another directory", ("a/deeper/dir", {}), ("b", {})),
    ("another thread count", ("one", {"num_threads": 1}), ("two", {"num_threads": 2})),
    ("a sentence sample", ("s1", {"input_sentence_size": 1000}), ("s2", {"input_sentence_size": 1000})),
]  # fmt: skip


@pytest.mark.parametrize(("first", "second"), [c[1:] for c in SAME_MODEL_CASES], ids=[c[0] for c in SAME_MODEL_CASES])
def test_one_corpus_gives_the_same_model_bytes_anywhere(tmp_path, corpus, first, second):
    models = []
    for where, options in (first, second):
        (tmp_path / where).mkdir(parents=True)
        models.append(train_tokenizer([corpus], tmp_path / where / "spm", 300, minloglevel=2, **options).read_bytes())
    assert models[0] == models[1]
    assert str(tmp_path).encode() not in models[0] and str(corpus).encode() not in models[0]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_a_sentence_sample_is_the_same_in_every_process(tmp_path, corpus):
    # more lines than input_sentence_size: SentencePiece's own sample is drawn anew in every process (measured: 6
    # processes, 6 different models); tokbin keeps lines spread evenly instead
    models = []
    for name in ("a", "b"):
        argv = ["train-tokenizer", "--input", str(corpus), "--model-prefix", str(tmp_path / name), "--vocab-size",
                "300", "--input-sentence-size", "1000", "--quiet"]  # fmt: skip
        run = subprocess.run([sys.executable, "-m", "tokbin.cli", *argv], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        models.append((tmp_path / f"{name}.model").read_bytes())
    assert models[0] == models[1]
    assert sum(1 for _ in corpus.open(encoding="utf-8")) > 1000


def test_the_portable_model_keeps_every_piece_and_id(tmp_path, corpus):
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "raw"), vocab_size=300,
                                   num_threads=2, minloglevel=2)  # fmt: skip
    raw = (tmp_path / "raw.model").read_bytes()
    portable = portable_model(raw)
    assert str(tmp_path).encode() in raw and str(tmp_path).encode() not in portable
    a, b = spm.SentencePieceProcessor(), spm.SentencePieceProcessor()
    a.LoadFromSerializedProto(raw)
    b.LoadFromSerializedProto(portable)
    assert [(a.id_to_piece(i), a.get_score(i)) for i in range(300)] == [(b.id_to_piece(i), b.get_score(i)) for i in
                                                                        range(300)]  # fmt: skip
    text = corpus.read_text(encoding="utf-8")
    assert a.encode(text) == b.encode(text)
    assert portable_model(portable) == portable


def _long_lines(n_bytes):  # lines of about 9 KB: all over SentencePiece's 4192-byte limit
    words = stdlib_text(n_bytes).split()
    return "".join(" ".join(words[i : i + 1200]) + "\n" for i in range(0, len(words) - 1199, 1200))


LONG_INPUT_CASES = [
    ("lines all over 4 KB", lambda: _long_lines(600_000)),
    ("5 MB without a newline", lambda: " ".join(stdlib_text(5_000_000).split())),
]


@pytest.mark.parametrize("make", [c[1] for c in LONG_INPUT_CASES], ids=[c[0] for c in LONG_INPUT_CASES])
def test_a_sample_of_long_lines_trains_a_tokenizer(tmp_path, make):
    text = make()
    assert min(len(line.encode()) for line in text.splitlines()) > 4192
    source = tmp_path / "long.txt"
    source.write_text(text, encoding="utf-8")
    with pytest.raises(TokenFileError, match=r"no line of .*long.txt fits max_sentence_length \(4192 bytes"):
        train_tokenizer([source], tmp_path / "direct", 600, **LOSSLESS)
    sample = tmp_path / "sample.txt"
    written = write_sample([source], sample, 100_000_000)
    raw = sample.read_bytes()
    assert written == len(raw) and max(len(line) for line in raw.split(b"\n")) <= SAMPLE_LINE_BYTES
    assert raw.replace(b"\n", b"") == text.encode().replace(b"\n", b"")  # only newlines added
    model = train_tokenizer([sample], tmp_path / "spm", 600, **LOSSLESS)
    tf = encode_files(model, [source], tmp_path / "ids.bin", progress=False)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert sp.decode([int(t) for t in tf.tokens[:-1]]) == text  # the whole input, lossless (EOS last)


SPLIT_CASES = [
    # (id, line, limit): every piece within the limit, cut before a space or between UTF-8 characters
    ("words", b"aaa bbb ccc", 8),
    ("no space, 2-byte characters", "é".encode() * 5000, SAMPLE_LINE_BYTES),
    ("no space, 4-byte characters", "🙂".encode() * 3000, 4098),
    ("short lines untouched", b"a b\nc d\n", 4),
    ("spaces only", b" " * 10_000, SAMPLE_LINE_BYTES),
]


@pytest.mark.parametrize(("line", "limit"), [c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES])
def test_split_long_lines(line, limit):
    out = split_long_lines(line, limit)
    assert out.replace(b"\n", b"") == line.replace(b"\n", b"")
    for part in out.split(b"\n"):
        assert len(part) <= limit
        part.decode("utf-8")  # no character cut in two
    if max(len(x) for x in line.split(b"\n")) <= limit:
        assert out == line
