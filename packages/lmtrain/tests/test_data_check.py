"""Token data is checked before training: headers against the model on every run, checksums and ids once per file
(then cached by size, modification time and inode), a damaged or too-wide file refused with one line."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tokbin
from lmtrain.data_check import CACHE_FILE, check_token_data
from lmtrain.errors import LmtrainError

VOCAB = 300


def token_file(path: Path, vocab: int = VOCAB) -> Path:
    rng = np.random.default_rng(0)
    tokbin.write_tokens(path, [rng.integers(3, vocab, size=n) for n in (400, 250)], vocab_size=vocab, eos_id=2)
    return path


@pytest.fixture
def reads(monkeypatch):
    """The paths TokenFile.verify read in full, in order."""
    seen: list[str] = []
    real = tokbin.TokenFile.verify

    def counting(self, *a, **k):
        seen.append(Path(self.path).name)
        return real(self, *a, **k)

    monkeypatch.setattr(tokbin.TokenFile, "verify", counting)
    return seen


def test_first_use_verifies_later_runs_read_nothing(tmp_path, reads):
    files = [token_file(tmp_path / "train.bin"), token_file(tmp_path / "val.bin")]
    said: list[str] = []
    assert check_token_data(files, VOCAB, say=said.append) == [str(f) for f in files]
    assert reads == ["train.bin", "val.bin"] and len(said) == 2 and "once" in said[0]
    cache = json.loads((tmp_path / CACHE_FILE).read_text())["files"]
    assert set(cache) == {"train.bin", "val.bin"} and cache["train.bin"]["max_id"] < VOCAB
    assert check_token_data(files, VOCAB, say=said.append) == []
    assert reads == ["train.bin", "val.bin"] and len(said) == 2  # the second run read no data


def test_a_changed_file_is_verified_again_and_a_damaged_one_refused(tmp_path, reads):
    path = token_file(tmp_path / "train.bin")
    check_token_data([path], VOCAB, say=lambda _: None)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one token: the header and the size are still right
    path.write_bytes(bytes(raw))
    with pytest.raises(LmtrainError) as info:
        check_token_data([path], VOCAB, say=lambda _: None)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and str(path) in message and "data checksum mismatch" in message
    assert "lmtrain prepare" in message and reads == ["train.bin", "train.bin"]


def test_a_header_wider_than_the_model_is_refused_naming_both(tmp_path, reads):
    path = token_file(tmp_path / "train.bin", vocab=VOCAB)
    with pytest.raises(LmtrainError) as info:
        check_token_data([path], VOCAB - 1, say=lambda _: None)
    message = str(info.value)
    assert f"vocab_size {VOCAB}" in message and f"the model's vocab_size is {VOCAB - 1}" in message
    assert f"--set vocab_size={VOCAB}" in message and reads == []  # refused before reading any data


def test_truncated_file_is_one_line(tmp_path):
    path = token_file(tmp_path / "train.bin")
    os.truncate(path, path.stat().st_size - 3)
    with pytest.raises(LmtrainError, match=r"train.bin: truncated: header says .* re-run `lmtrain prepare`"):
        check_token_data([path], VOCAB)


def test_shards_and_blends_are_checked_file_by_file(tmp_path, reads):
    a, b = token_file(tmp_path / "a.bin"), token_file(tmp_path / "b.bin")
    blend = tokbin.Blend([tokbin.TokenFile(a), tokbin.TokenFile(b)], [1, 1])
    assert check_token_data([blend], VOCAB, say=lambda _: None) == [str(a), str(b)]
    assert reads == ["a.bin", "b.bin"]


def test_read_only_data_keeps_its_cache_in_the_run_directory(tmp_path, reads, monkeypatch):
    import lmtrain.data_check as data_check

    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    path = token_file(data / "train.bin")
    real_open = os.open

    def read_only(p, flags, *a):  # what a read-only data directory answers (the tests may run as root)
        if Path(p).parent == data and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real_open(p, flags, *a)

    monkeypatch.setattr(data_check.os, "open", read_only)
    check_token_data([path], VOCAB, fallback_cache_dir=run, say=lambda _: None)
    assert not (data / CACHE_FILE).exists()
    assert str(path.resolve()) in json.loads((run / CACHE_FILE).read_text())["files"]
    check_token_data([path], VOCAB, fallback_cache_dir=run, say=lambda _: None)
    assert reads == ["train.bin"]


def test_concurrent_runs_read_a_file_once(tmp_path, reads, monkeypatch):
    path = token_file(tmp_path / "train.bin")
    real = tokbin.TokenFile.verify

    def slow(self, *a, **k):
        time.sleep(0.5)  # long enough for the other thread to be waiting on the lock
        return real(self, *a, **k)

    monkeypatch.setattr(tokbin.TokenFile, "verify", slow)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            check_token_data([path], VOCAB, say=lambda _: None)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and reads == ["train.bin"]
