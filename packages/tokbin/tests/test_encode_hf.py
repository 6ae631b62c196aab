"""``encode_files`` with a Hugging Face tokenizer: every document's ids equal the ``tokenizers`` library's own encode
of it (plus EOS), in the worker processes as in one, for any piece size; the header records the tokenizer's
identity; vocabularies over 65536 ids are stored as uint32."""

import itertools
import multiprocessing
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import stdlib_text, write_hf_dir

from tokbin import TokenFile, TokenFileError, encode_files, encode_inputs, load_tokenizer
from tokbin.cli import main
from tokbin.documents import split_documents

pytest.importorskip("tokenizers")


def _documents(tf: TokenFile) -> list[list[int]]:
    return [np.asarray(tf.document(i)).tolist() for i in range(tf.n_docs)]


def test_documents_equal_the_tokenizers_encode(tmp_path, qwen_dir, qwen_bpe, wiki_text):
    tok = load_tokenizer(qwen_dir)
    text = wiki_text.read_text(encoding="utf-8")
    docs = split_documents(text)
    assert len(docs) > 50 and any("\n\n" in d for d in docs)  # blank-line runs: Qwen2's regex joins them
    expected = [qwen_bpe.encode(d, add_special_tokens=False).ids + [tok.eos_id] for d in docs]
    one = encode_files(qwen_dir, [wiki_text], tmp_path / "one.bin", split_docs=True, workers=1, progress=False)
    assert _documents(one) == expected
    # two worker processes and pieces far smaller than the text: the same bytes
    two = encode_files(qwen_dir, [wiki_text], tmp_path / "two.bin", split_docs=True, workers=2, piece_bytes=4096,
                       progress=False)  # fmt: skip
    assert two.path.read_bytes() == one.path.read_bytes()
    assert (one.tokenizer_sha256, one.vocab_size, one.eos_id) == (tok.sha256, tok.vocab_size, tok.eos_id)
    one.verify(qwen_dir)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_plain_text_file_is_one_document_read_in_pieces(tmp_path, qwen_dir, qwen_bpe, monkeypatch, workers):
    # line by line, "a\n\n  b" would be cut where Qwen2's pre-tokenizer joins "\n\n" and the indentation; cut only
    # between printable bytes, the pieces' ids are the whole text's, and no piece holds the whole file
    import tokbin.encode

    path = tmp_path / "doc.txt"
    text = "".join(line.lstrip(" ") for line in stdlib_text(30_000).splitlines(keepends=True))  # cuts: line starts
    path.write_text(text, encoding="utf-8")
    sizes = []
    if workers == 1:  # in this process: the pieces can be seen
        encode_piece = tokbin.encode.encode_piece
        monkeypatch.setattr(tokbin.encode, "encode_piece", lambda tok, piece, *a: sizes.append(len(piece.data))
                            or encode_piece(tok, piece, *a))  # fmt: skip
    tf = encode_files(qwen_dir, [path], tmp_path / "o.bin", workers=workers, piece_bytes=1024, progress=False)
    assert tf.n_docs == 1 and _documents(tf)[0][:-1] == qwen_bpe.encode(text, add_special_tokens=False).ids
    lines = [i for line in text.splitlines(keepends=True) for i in qwen_bpe.encode(line).ids]
    assert lines != _documents(tf)[0][:-1]  # the test would not notice a line-by-line encode otherwise
    if workers == 1:
        assert len(sizes) > 10 and max(sizes) < len(text.encode()) / 4, sizes


def _metaspace_dir(directory, text):
    """A SentencePiece-style tokenizer.json (Llama 2's, Mistral's): Metaspace puts "▁" before each text's start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"], show_progress=False))
    return write_hf_dir(directory, tok, {"eos_token": "</s>", "bos_token": None, "unk_token": None})


def _gpt2_dir(directory, text):
    """GPT-2's pipeline (SmolLM2's): byte-level with its own regex, whose \\s+(?!\\S) splits the last character of a
    whitespace run off when a word follows, so a cut inside a longer run would change the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    return write_hf_dir(directory, tok, {"eos_token": "<|endoftext|>", "bos_token": None, "unk_token": None})


def test_only_tokenizers_whose_ids_cannot_tell_a_cut_are_read_in_pieces(tmp_path, qwen_dir, llama3_dir):
    assert load_tokenizer(qwen_dir).cuts_at_line_ends and load_tokenizer(llama3_dir).cuts_at_line_ends
    gpt2 = load_tokenizer(_gpt2_dir(tmp_path / "gpt2", stdlib_text(60_000)))
    assert gpt2.cuts_at_line_ends
    runs = "    pass\n\n\n\nclass A:\n" * 20 + "a = 1   \n\nb = 2\n" * 20  # whitespace runs ending in a line end
    naive = [m.end() for m in re.finditer(r"\n(?=[!-~])", runs)]
    pieces = [runs[a:b] for a, b in itertools.pairwise([0, *naive, len(runs)])]
    assert sum(gpt2.encode_batch(pieces), []) != gpt2.encode(runs)  # cut after any line end, the ids would change
    path = tmp_path / "runs.txt"
    path.write_text(runs, encoding="utf-8", newline="")
    tf = encode_files(gpt2.path, [path], tmp_path / "runs.bin", workers=1, piece_bytes=64, progress=False)
    assert _documents(tf) == [gpt2.encode(runs) + [gpt2.eos_id]]
    text = stdlib_text(20_000)
    meta = load_tokenizer(_metaspace_dir(tmp_path / "meta", text))
    cuts = [m.end() for m in re.finditer(r"(?<=[!-~])\n(?=[!-~])", text)]
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    assert sum(meta.encode_batch(pieces), []) != meta.encode(text)  # cut, a Metaspace tokenizer's ids change
    assert not meta.cuts_at_line_ends
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    tf = encode_files(meta.path, [path], tmp_path / "o.bin", workers=1, piece_bytes=1024, progress=False)
    assert _documents(tf) == [meta.encode(text) + [meta.eos_id]]  # so it reads the file whole


def test_jsonl_with_a_hf_tokenizer(tmp_path, llama3_dir, llama3_bpe):
    path = tmp_path / "d.jsonl"
    texts = ["first doc\n\n  indented", "second: <|eot_id|> kept as one token", "third"]
    path.write_text("".join(f'{{"text": {t!r}}}\n'.replace("'", '"') for t in texts), encoding="utf-8")
    tf = encode_files(llama3_dir, [path], tmp_path / "o.bin", jsonl_field="text", progress=False)
    eot = llama3_bpe.token_to_id("<|eot_id|>")
    assert _documents(tf) == [llama3_bpe.encode(t, add_special_tokens=False).ids + [eot] for t in texts]


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path, qwen_bpe):
    import tokenizers

    big = tokenizers.Tokenizer.from_str(qwen_bpe.to_str())
    big.add_special_tokens([tokenizers.AddedToken(f"<extra_{i}>", special=True) for i in range(70_000)])
    d = write_hf_dir(tmp_path / "big", big, {"eos_token": "<|im_end|>"})
    tok = load_tokenizer(d)
    assert tok.vocab_size == big.get_vocab_size() > 65536
    path = tmp_path / "x.txt"
    path.write_text("hello <extra_69999> and <extra_0> world", encoding="utf-8")
    tf = encode_files(d, [path], tmp_path / "o.bin", workers=2, progress=False)
    ids = _documents(tf)[0]
    assert tf.dtype == np.dtype("<u4") and tf.vocab_size == tok.vocab_size
    assert big.token_to_id("<extra_69999>") in ids and max(ids) > 65535
    assert ids == [*big.encode(path.read_text(), add_special_tokens=False).ids, tok.eos_id]
    assert tf.verify(d)["max_id"] == max(ids)


def test_spawned_workers_receive_the_tokenizer_pickled(tmp_path, qwen_dir, wiki_text, monkeypatch):
    # where fork is missing (macOS, Windows) the pool spawns and the tokenizer travels as its JSON text
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    spawned = encode_files(qwen_dir, [wiki_text], tmp_path / "s.bin", split_docs=True, workers=2, piece_bytes=8192,
                           progress=False)  # fmt: skip
    one = encode_files(qwen_dir, [wiki_text], tmp_path / "o.bin", split_docs=True, workers=1, progress=False)
    assert spawned.path.read_bytes() == one.path.read_bytes()


def test_verify_and_resume_refuse_another_tokenizer(tmp_path, qwen_dir, llama3_dir, lossless_model, wiki_text):
    tf = encode_files(qwen_dir, [wiki_text], tmp_path / "o.bin", progress=False)
    for other in (llama3_dir, lossless_model):
        with pytest.raises(TokenFileError, match="tokenizer mismatch"):
            tf.verify(other)
    assert main(["verify", str(tf.path), "--tokenizer", str(qwen_dir), "--quiet"]) == 0
    out = tmp_path / "shards"
    encode_inputs(qwen_dir, [wiki_text], out, shard_bytes=20_000, progress=False)
    with pytest.raises(TokenFileError, match=r"shards: holds shards encoded with tokenizer sha256 .* not "):
        encode_inputs(llama3_dir, [wiki_text], out, shard_bytes=20_000, progress=False)


def test_cli_encodes_with_a_model_directory(tmp_path, qwen_dir, wiki_text):
    argv = ["encode", "--tokenizer", str(qwen_dir), "--input", str(wiki_text), "--output", str(tmp_path / "o.bin"),
            "--split-docs", "--quiet"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "tokbin.cli", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr.lower()  # no fork warning from tokenizers' thread pool
    assert TokenFile(tmp_path / "o.bin").tokenizer_sha256 == load_tokenizer(qwen_dir).sha256
