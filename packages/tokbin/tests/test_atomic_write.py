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
