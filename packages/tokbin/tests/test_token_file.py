import struct

import numpy as np
import pytest
import torch

from tokbin import BLOCK_TOKENS, TokenFile, TokenFileError, write_tokens
from tokbin.fileformat import HEADER_SIZE, offsets_start


def _docs(rng, n_docs=5, vocab=1000):
    return [rng.integers(0, vocab, size=int(rng.integers(1, 50))) for _ in range(n_docs)]


def test_round_trip_counts_offsets_and_header(tmp_path):
    rng = np.random.default_rng(0)
    docs = _docs(rng)
    tf = write_tokens(tmp_path / "a.bin", docs, vocab_size=1000, eos_id=3, tokenizer_sha256="ab" * 32)
    assert tf.n_docs == 5 and tf.n_tokens == sum(d.size for d in docs)
    assert tf.dtype == np.uint16 and tf.eos_id == 3 and tf.tokenizer_sha256 == "ab" * 32
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(tf.document(i), d)
    assert isinstance(tf.tokens, np.memmap) and not tf.tokens.flags.writeable
    assert tf.verify()["max_id"] == max(int(d.max()) for d in docs)


def test_single_array_is_one_document(tmp_path):
    tf = write_tokens(tmp_path / "a.bin", np.arange(10), vocab_size=10)
    assert tf.n_docs == 1 and tf.eos_id is None and tf.tokenizer_sha256 is None


def test_uint16_boundary_and_uint32_path(tmp_path):
    tf16 = write_tokens(tmp_path / "u16.bin", np.array([0, 65535]), vocab_size=65536)
    assert tf16.dtype == np.uint16 and tf16.tokens[1] == 65535
    ids = np.array([0, 65535, 65536, 99_999], dtype=np.int64)
    tf32 = write_tokens(tmp_path / "u32.bin", ids, vocab_size=100_000)
    assert tf32.dtype == np.uint32
    np.testing.assert_array_equal(tf32.tokens, ids)  # 65536 did not wrap to 0
    tf32.verify()
    assert tf32.window(2, 2).dtype == torch.uint32
    x, y = tf32.gather(np.array([0]), 3)
    assert x.tolist() == [[0, 65535, 65536]] and y.tolist() == [[65535, 65536, 99_999]]


@pytest.mark.parametrize("bad", [65536, -1])
def test_id_that_does_not_fit_is_an_error_and_leaves_no_file(tmp_path, bad):
    out = tmp_path / "bad.bin"
    with pytest.raises(TokenFileError, match=f"id {bad} does not fit"):
        write_tokens(out, [np.array([1, 2]), np.array([3, bad])], vocab_size=65536)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.bin.lock"]  # the temp file was removed


def test_empty_input_is_an_error(tmp_path):
    with pytest.raises(TokenFileError, match="no tokens"):
        write_tokens(tmp_path / "e.bin", [], vocab_size=100)
    assert not (tmp_path / "e.bin").exists()


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(1)
    return write_tokens(tmp_path / "g.bin", _docs(rng, 20), vocab_size=1000, eos_id=0).path


def test_truncated_by_one_token(good):
    data = good.read_bytes()
    n = TokenFile(good).n_tokens
    # drop the last token: the offsets move 2 bytes but the header still counts n tokens
    cut = data[: HEADER_SIZE + 2 * (n - 1)] + data[HEADER_SIZE + 2 * n :]
    good.write_bytes(cut)
    with pytest.raises(TokenFileError, match=r"truncated: header says \d+ tokens .* file has \d+ bytes"):
        TokenFile(good)


def test_over_long(good):
    with open(good, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(TokenFileError, match="over-long"):
        TokenFile(good)


def test_flipped_token_byte_fails_checksum(good):
    data = bytearray(good.read_bytes())
    data[HEADER_SIZE + 7] ^= 0x01  # a low bit: the id stays below the vocabulary, only the checksum can tell
    good.write_bytes(bytes(data))
    tf = TokenFile(good)  # opening checks only the header and size
    with pytest.raises(TokenFileError, match="data checksum mismatch"):
        tf.verify()


def test_flipped_offset_byte_fails_checksum(good):
    tf = TokenFile(good)
    pos = offsets_start(tf.n_tokens, 2) + 8 * 3
    data = bytearray(good.read_bytes())
    data[pos] ^= 0x01
    good.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="data checksum mismatch"):
        TokenFile(good).verify()


def test_flipped_header_byte_is_caught_on_open(good):
    data = bytearray(good.read_bytes())
    data[24] ^= 0x01  # vocab_size field
    good.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="header checksum mismatch"):
        TokenFile(good)


def test_foreign_file(tmp_path):
    p = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(p)  # a headerless nanoGPT-style file
    with pytest.raises(TokenFileError, match="not a tokbin file") as e:
        TokenFile(p)
    assert str(p) in str(e.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.bin"
    p.write_bytes(b"")
    with pytest.raises(TokenFileError, match="not a tokbin file: file is empty"):
        TokenFile(p)


def test_unknown_version(good):
    import zlib

    data = bytearray(good.read_bytes())
    data[8:12] = struct.pack("<I", 99)
    data[120:124] = struct.pack("<I", zlib.crc32(bytes(data[:120])))  # a well-formed header of a future version
    good.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="unknown format version: expected 1, found 99"):
        TokenFile(good)


def test_verify_catches_id_above_vocab_in_a_consistent_file(tmp_path):
    # a file whose checksum is right but whose header claims a smaller vocabulary: what a buggy writer produces
    import zlib

    p = write_tokens(tmp_path / "v.bin", np.array([1, 2, 900]), vocab_size=1000).path
    data = bytearray(p.read_bytes())
    data[24:32] = struct.pack("<Q", 500)
    data[120:124] = struct.pack("<I", zlib.crc32(bytes(data[:120])))
    p.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="expected ids < vocab_size 500, found 900"):
        TokenFile(p).verify()


def test_window_and_block_are_zero_copy(tmp_path):
    ids = np.arange(BLOCK_TOKENS + 100) % 60000
    tf = write_tokens(tmp_path / "w.bin", ids, vocab_size=60000)
    w = tf.window(10, 5)
    assert w.dtype == torch.uint16 and w.tolist() == list(range(10, 15))
    assert w.data_ptr() == tf.tokens[10:].ctypes.data  # shares the memmap's pages
    assert tf.n_blocks == 2 and tf.block(0).numel() == BLOCK_TOKENS and tf.block(1).numel() == 100
    assert tf.block(1)[0].item() == BLOCK_TOKENS % 60000
    with pytest.raises(IndexError):
        tf.window(BLOCK_TOKENS + 90, 20)


def test_gather_shifts_targets_and_widens(tmp_path):
    ids = np.arange(5000) % 1000
    tf = write_tokens(tmp_path / "g.bin", ids, vocab_size=1000)
    starts = np.array([0, 17, 3000, 5000 - 65])
    x, y = tf.gather(starts, 64)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    for r, s in enumerate(starts):
        assert x[r].tolist() == ids[s : s + 64].tolist()
        assert y[r].tolist() == ids[s + 1 : s + 65].tolist()
    with pytest.raises(IndexError):
        tf.gather(np.array([5000 - 64]), 64)


def test_gather_many_equals_separate_gathers(tmp_path):
    rng = np.random.default_rng(3)
    tf = write_tokens(tmp_path / "m.bin", rng.integers(0, 1000, size=5000), vocab_size=1000)
    starts = [rng.integers(0, 5000 - 65, size=n) for n in (4, 1, 7)]  # batches of different sizes, one seq_len
    got = tf.gather_many(starts, 64)
    assert len(got) == 3
    for st, (x, y) in zip(starts, got, strict=True):
        ex, ey = tf.gather(st, 64)
        assert torch.equal(x, ex) and torch.equal(y, ey) and x.is_contiguous() and y.is_contiguous()
    with pytest.raises(IndexError, match="exceed the 5000 tokens"):
        tf.gather_many([starts[0], np.array([5000 - 64])], 64)
    with pytest.raises(ValueError, match="expected 1-D starts"):
        tf.gather_many([starts[0], np.zeros((2, 2), dtype=np.int64)], 64)


def test_pickle_reopens_by_path_instead_of_copying(tmp_path):
    import pickle

    tf = write_tokens(tmp_path / "p.bin", np.arange(100_000) % 1000, vocab_size=1000)
    blob = pickle.dumps(tf)
    assert len(blob) < 1000  # 100k tokens would be 200 KB if the memmap were pickled
    again = pickle.loads(blob)
    assert again.n_tokens == tf.n_tokens and np.array_equal(again.tokens[:10], tf.tokens[:10])
