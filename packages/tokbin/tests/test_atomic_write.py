import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tokbin import TokenFile, TokenFileError, write_tokens

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    from tokbin import write_tokens

    out, ready = Path(sys.argv[1]), Path(sys.argv[2])

    def docs():
        for i in range(1000):
            yield np.full(10_000, i % 100)
            if i == 50:
                ready.write_text("mid-write")  # tell the parent we are half way through
                time.sleep(60)

    write_tokens(out, docs(), vocab_size=100)
    """
)


def _start_writer(tmp_path, out):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"writer subprocess did not reach mid-write (exit code {proc.returncode})")
        time.sleep(0.05)
    return proc


def test_killed_writer_leaves_no_file_under_the_final_name(tmp_path):
    out = tmp_path / "data.bin"
    proc = _start_writer(tmp_path, out)
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size > 0  # it really was writing
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    # the kill released the lock: a new writer succeeds and produces a complete file
    tf = write_tokens(out, np.arange(10), vocab_size=100)
    assert tf.n_tokens == 10 and tf.verify()


def test_second_writer_gets_a_clear_error(tmp_path):
    out = tmp_path / "data.bin"
    proc = _start_writer(tmp_path, out)
    try:
        with pytest.raises(TokenFileError, match="another writer holds data.bin.lock") as e:
            write_tokens(out, np.arange(10), vocab_size=100)
        assert str(out) in str(e.value)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not out.exists()


def test_overwrite_replaces_atomically(tmp_path):
    out = tmp_path / "data.bin"
    write_tokens(out, np.arange(10), vocab_size=100)
    old = TokenFile(out)
    write_tokens(out, np.arange(20), vocab_size=100)
    assert TokenFile(out).n_tokens == 20
    assert old.tokens[9] == 9 and old.n_tokens == 10  # an open reader keeps the old inode intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.bin.lock"]


def test_error_in_producer_leaves_no_file(tmp_path):
    out = tmp_path / "data.bin"

    def docs():
        yield np.arange(10)
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        write_tokens(out, docs(), vocab_size=100)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_missing_directory(tmp_path):
    with pytest.raises(TokenFileError, match="does not exist"):
        write_tokens(tmp_path / "nope" / "x.bin", np.arange(3), vocab_size=10)


ENCODE_PAUSED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import tokbin.encode as encode

    ready, real, calls = Path(sys.argv[1]), encode.encode_piece, []

    def paused(*args):  # a real encode that stops half way, so the parent can kill it there
        calls.append(1)
        if len(calls) == 3:
            ready.write_text("mid-write")
            time.sleep(120)
        return real(*args)

    encode.encode_piece = paused
    from tokbin.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)

LIVE_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tokbin.writer import atomic_output

    out, ready = Path(sys.argv[1]), Path(sys.argv[2])
    with atomic_output(out, lock=False) as f:  # a writer whose caller holds a lock of its own, not out's
        f.write(b"partial")
        f.flush()
        ready.write_text("mid-write")
        time.sleep(120)
    """
)


def _wait_for(proc, ready):
    deadline = time.monotonic() + 120  # only to detect a hang
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"subprocess did not reach mid-write (exit code {proc.returncode})")
        time.sleep(0.05)


def _temps(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_the_next_encode_removes_what_a_killed_encode_left(tmp_path, lossless_model, corpus):
    from tokbin import encode_files
    from tokbin.cli import main

    out = tmp_path / "data.bin"
    argv = ["encode", "--tokenizer", str(lossless_model), "--input", str(corpus), "--output", str(out),
            "--workers", "1", "--piece-kb", "2", "--quiet"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", ENCODE_PAUSED, str(tmp_path / "ready"), *argv])
    _wait_for(proc, tmp_path / "ready")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    left = _temps(tmp_path)
    assert len(left) == 1 and left[0].startswith(".data.bin.") and not out.exists()  # what the kill leaves

    assert main(argv) == 0
    assert _temps(tmp_path) == []
    reference = encode_files(lossless_model, [corpus], tmp_path / "reference.bin", progress=False)
    assert TokenFile(out).verify() and TokenFile(out).data_sha256 == reference.data_sha256


def test_a_live_writers_temp_file_is_left_alone(tmp_path):
    out = tmp_path / "data.bin"
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(out), str(tmp_path / "ready")])
    try:
        _wait_for(proc, tmp_path / "ready")
        live = _temps(tmp_path)
        assert len(live) == 1
        write_tokens(out, np.arange(10), vocab_size=100)  # takes out's lock, which the live writer does not hold
        assert _temps(tmp_path) == live and (tmp_path / live[0]).read_bytes() == b"partial"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    write_tokens(out, np.arange(10), vocab_size=100)  # its writer is dead now: stale
    assert _temps(tmp_path) == [] and TokenFile(out).n_tokens == 10


NOT_STALE = [
    # (id, name next to data.bin, a symlink?): what a write to data.bin must not remove, though no writer holds it
    ("another target's temp", ".data.bin.x.abcdefgh.tmp", False),
    ("a temp of another file", ".other.bin.abcdefgh.tmp", False),
    ("not hidden", "data.bin.abcdefgh.tmp", False),
    ("not mkstemp's name", ".data.bin.ABCDEFGH.tmp", False),
    ("a symlink named like a temp", ".data.bin.abcdefgh.tmp", True),
]


@pytest.mark.parametrize(("name", "link"), [c[1:] for c in NOT_STALE], ids=[c[0] for c in NOT_STALE])
def test_a_write_removes_only_its_own_stale_temp_files(tmp_path, name, link):
    decoy = tmp_path / "decoy.txt"
    decoy.write_bytes(b"keep me")
    stale = tmp_path / ".data.bin.zz99__aa.tmp"  # as a killed writer of data.bin leaves it
    stale.write_bytes(b"partial")
    other = tmp_path / name
    if link:
        other.symlink_to(decoy)
    else:
        other.write_bytes(b"not data.bin's")
    write_tokens(tmp_path / "data.bin", np.arange(10), vocab_size=100)
    assert not stale.exists()
    assert other.is_symlink() == link and other.read_bytes() == (b"keep me" if link else b"not data.bin's")
    assert decoy.read_bytes() == b"keep me"
