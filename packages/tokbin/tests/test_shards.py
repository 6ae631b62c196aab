import json
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tokbin import HashSplit, ShardedTokens, TokenFile, TokenFileError, encode_files, encode_inputs, open_tokens
from tokbin.shards import MANIFEST

SHARD_BYTES = 20_000


@pytest.fixture(scope="module")
def inputs(corpus, wiki_text):
    return [corpus, wiki_text]


@pytest.fixture(scope="module")
def single(inputs, lossless_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "all.bin"
    return encode_files(lossless_model, inputs, out, split_docs=True, progress=False)


@pytest.fixture(scope="module")
def sharded(inputs, lossless_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "shards"
    return encode_files(lossless_model, inputs, out, split_docs=True, shard_bytes=SHARD_BYTES, progress=False)


def shard_bytes_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.bin"))}


def test_shards_hold_the_single_file_tokens_and_documents(single, sharded):
    assert isinstance(sharded, ShardedTokens) and len(sharded.shards) > 10
    assert sharded.n_tokens == single.n_tokens and sharded.n_docs == single.n_docs
    assert np.array_equal(np.concatenate([np.asarray(s.tokens) for s in sharded.shards]), np.asarray(single.tokens))
    assert np.array_equal(sharded.doc_offsets, np.asarray(single.doc_offsets))
    for i in (0, 7, sharded.n_docs - 1):
        assert np.array_equal(sharded.document(i), single.document(i))
    assert sharded.vocab_size == single.vocab_size and sharded.eos_id == single.eos_id
    assert sharded.tokenizer_sha256 == single.tokenizer_sha256
    manifest = json.loads((sharded.path / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["shards"]) == len(sharded.shards)
    assert all(s["n_tokens"] > 0 and len(s["data_sha256"]) == 64 for s in manifest["shards"])


def test_shard_boundaries_do_not_depend_on_pieces_or_workers(tmp_path, inputs, lossless_model, sharded):
    other = encode_files(lossless_model, inputs, tmp_path / "s", split_docs=True, shard_bytes=SHARD_BYTES,
                         piece_bytes=777, workers=2, progress=False)  # fmt: skip
    assert shard_bytes_of(other.path) == shard_bytes_of(sharded.path)


def test_a_hash_split_is_sharded_like_the_whole(tmp_path, inputs, lossless_model):
    part = HashSplit(0.1, "train")
    whole = encode_inputs(lossless_model, inputs, tmp_path / "one.bin", split_docs=True, hash_split=part,
                          progress=False).tokens  # fmt: skip
    shards = encode_inputs(lossless_model, inputs, tmp_path / "shards", split_docs=True, hash_split=part,
                           shard_bytes=SHARD_BYTES, progress=False).tokens  # fmt: skip
    assert len(shards.shards) > 10 and shards.n_docs == whole.n_docs
    assert np.array_equal(np.concatenate([np.asarray(s.tokens) for s in shards.shards]), np.asarray(whole.tokens))


def test_gather_across_shard_boundaries_matches_the_single_file(single, sharded):
    seq_len = 64
    ends = [int(s) for s in np.cumsum([s.n_tokens for s in sharded.shards])[:-1]]
    spanning = np.array([e - k for e in ends[:5] for k in (1, 10, seq_len)])
    rng = np.random.default_rng(0)
    last = single.n_tokens - seq_len - 1
    starts = [spanning, rng.integers(0, last, 50), np.array([0, last])]
    for (x, y), (xs, ys) in zip(sharded.gather_many(starts, seq_len), single.gather_many(starts, seq_len), strict=True):
        assert x.dtype == xs.dtype and np.array_equal(x.numpy(), xs.numpy()) and np.array_equal(y.numpy(), ys.numpy())
    x, y = sharded.gather(spanning, seq_len)
    assert x.shape == (len(spanning), seq_len) and np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    with pytest.raises(IndexError, match="exceed"):
        sharded.gather(np.array([sharded.n_tokens - seq_len]), seq_len)


def test_open_tokens_info_and_verify(sharded, single, lossless_model, other_model):
    assert isinstance(open_tokens(sharded.path), ShardedTokens)
    assert isinstance(open_tokens(sharded.path / MANIFEST), ShardedTokens)
    assert isinstance(open_tokens(single.path), TokenFile)
    info = sharded.info()
    assert info["shards"] == len(sharded.shards) and info["n_tokens"] == single.n_tokens
    assert sharded.verify(lossless_model)["max_id"] < 500
    with pytest.raises(TokenFileError, match="tokenizer mismatch"):
        sharded.verify(other_model)


def test_readers_refuse_incomplete_or_escaping_manifests(tmp_path, sharded):
    manifest = json.loads((sharded.path / MANIFEST).read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(TokenFileError, match="incomplete encode"):
        ShardedTokens(bad)
    (bad / MANIFEST).write_text(json.dumps({**manifest, "shards": [{**manifest["shards"][0], "file": "../x.bin"}]}))
    with pytest.raises(TokenFileError, match="expected a file name inside"):
        ShardedTokens(bad)


def test_damaged_shard_fails_verify(tmp_path, inputs, lossless_model):
    ds = encode_files(lossless_model, inputs, tmp_path / "s", split_docs=True, shard_bytes=50_000, progress=False)
    victim = ds.shards[1].path
    data = bytearray(victim.read_bytes())
    data[200] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match=r"shard-00001.bin: data checksum mismatch"):
        ShardedTokens(tmp_path / "s").verify()


SLOW_ENCODE = textwrap.dedent(
    """
    import sys, time
    import tokbin.encode as encode

    real = encode.encode_piece

    def slow(*args):  # a few pieces a second, so the parent can kill the encode half way
        time.sleep(0.02)
        return real(*args)

    encode.encode_piece = slow
    from tokbin.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _command(model, inputs, out):
    return ["encode", "--tokenizer", str(model), "--input", *map(str, inputs), "--output", str(out), "--split-docs",
            "--shard-mb", str(SHARD_BYTES / 1e6), "--workers", "1", "--piece-kb", "2", "--quiet"]  # fmt: skip


def test_sigkill_then_rerun_resumes_and_matches(tmp_path, inputs, lossless_model, sharded):
    out = tmp_path / "shards"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_ENCODE, *_command(lossless_model, inputs, out)])
    deadline = time.monotonic() + 120
    done = 0
    while done < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the encode did not reach 3 shards before it ended (exit code {proc.returncode})")
        time.sleep(0.05)
        try:
            done = len(json.loads((out / MANIFEST).read_text())["shards"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed = json.loads((out / MANIFEST).read_text())
    assert not killed["complete"] and 3 <= len(killed["shards"]) < len(sharded.shards)
    with pytest.raises(TokenFileError, match="incomplete encode"):
        ShardedTokens(out)  # what the kill left does not open as a dataset
    before = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in killed["shards"]}

    rerun = subprocess.run([sys.executable, "-m", "tokbin.cli", *_command(lossless_model, inputs, out)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert f"({len(killed['shards'])} kept from an earlier run)" in rerun.stdout
    assert {name: (out / name).stat().st_mtime_ns for name in before} == before  # finished shards not rewritten
    assert shard_bytes_of(out) == shard_bytes_of(sharded.path)
    assert ShardedTokens(out).data_sha256 == sharded.data_sha256
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_rerun_reencodes_from_a_damaged_shard(tmp_path, inputs, lossless_model, sharded):
    out = tmp_path / "s"
    encode_files(lossless_model, inputs, out, split_docs=True, shard_bytes=SHARD_BYTES, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))  # as if killed after the last shard
    victim = out / manifest["shards"][2]["file"]
    data = bytearray(victim.read_bytes())
    data[300] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = encode_inputs(lossless_model, inputs, out, split_docs=True, shard_bytes=SHARD_BYTES, progress=False)
    assert result.resumed_shards == 2
    assert shard_bytes_of(out) == shard_bytes_of(sharded.path)


def test_rerun_with_other_options_is_refused(tmp_path, inputs, lossless_model):
    out = tmp_path / "s"
    encode_files(lossless_model, inputs, out, split_docs=True, shard_bytes=SHARD_BYTES, progress=False)
    with pytest.raises(TokenFileError, match=r"holds shards of another encode \(clean differ\)"):
        encode_files(lossless_model, inputs, out, split_docs=True, clean=True, shard_bytes=SHARD_BYTES, progress=False)


def test_loader_reads_shards_as_it_reads_the_single_file(single, sharded):
    from tokbin import Loader, RandomWindows

    batches = []
    for ds in (single, sharded):
        with Loader(ds, RandomWindows(ds.n_tokens, 128, 4, seed=3)) as loader:
            batches.append([next(loader) for _ in range(5)])
    for (x, y), (xs, ys) in zip(*batches, strict=True):
        assert np.array_equal(x.numpy(), xs.numpy()) and np.array_equal(y.numpy(), ys.numpy())


def test_a_held_out_tail_after_the_last_shard_still_ends_the_input(tmp_path, lossless_model):
    # The documents after the last shard all belong to the other part of a hash split: the manifest must still say
    # the last shard ends the input, or readers take the directory for one with shards left out.
    part = HashSplit(0.5, "train")

    def kept(text):
        src = tmp_path / "one.jsonl"
        src.write_text(json.dumps({"text": text}) + "\n")
        try:
            encode_files(lossless_model, [src], tmp_path / "one.bin", jsonl_field="text", hash_split=part,
                         progress=False)  # fmt: skip
        except TokenFileError:
            return False
        return True

    head = next(f"kept document {i}" for i in range(100) if kept(f"kept document {i}"))
    tail = next(f"held out {i}" for i in range(100) if not kept(f"held out {i}"))
    src = tmp_path / "two.jsonl"
    src.write_text(json.dumps({"text": head}) + "\n" + json.dumps({"text": tail}) + "\n")
    ds = encode_inputs(lossless_model, [src], tmp_path / "shards", jsonl_field="text", hash_split=part,
                       shard_bytes=1, progress=False).tokens  # fmt: skip
    assert len(ds.shards) == 1 and ds.n_docs == 1
    assert ShardedTokens(ds.path).manifest["shards"][-1]["end"] == [1, 0, 1]
