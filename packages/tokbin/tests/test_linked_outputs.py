"""No output is written through a link: a token file, a tokenizer's ``.model`` and ``.vocab`` (which SentencePiece
writes itself) and a writer's lock file that are symbolic or hard links are refused before anything is written, and
the file they point at is left as it was. A write the filesystem refuses (the file size limit, a read-only or full
filesystem) is one line naming the output."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tokbin import TokenFileError, train_tokenizer, write_tokens
from tokbin.sample import write_sample

VICTIM = b"a user's own file\n"


def _symlink(target: Path, victim: Path) -> None:
    target.symlink_to(victim)


def _hardlink(target: Path, victim: Path) -> None:
    os.link(victim, target)


def _dangling_lock(target: Path, victim: Path) -> None:  # the lock a writer creates beside its output
    victim.unlink()
    target.with_name(target.name + ".lock").symlink_to(victim)


def _tokens(out: Path, corpus: Path) -> None:
    write_tokens(out, [np.array([5, 6, 2])], vocab_size=100)


def _model(out: Path, corpus: Path) -> None:
    train_tokenizer([corpus], out.with_suffix(""), 300, minloglevel=2)


def _sample(out: Path, corpus: Path) -> None:
    write_sample([corpus], out, 10_000)


# (case, the file made a link, the writer)
OUTPUTS = [
    ("token file", "ids.bin", _tokens),
    ("tokenizer .model", "spm.model", _model),
    ("tokenizer .vocab", "spm.vocab", _model),
    ("tokenizer sample", "sample.txt", _sample),
]
LINKS = [("symbolic link", _symlink), ("hard link", _hardlink)]


@pytest.mark.parametrize("link", [k[1] for k in LINKS], ids=[k[0] for k in LINKS])
@pytest.mark.parametrize(("name", "write"), [o[1:] for o in OUTPUTS], ids=[o[0] for o in OUTPUTS])
def test_an_output_that_is_a_link_is_refused_and_its_target_kept(tmp_path, corpus, name, write, link):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    link(out_dir / name, victim)
    with pytest.raises(TokenFileError) as info:
        write(out_dir / name, corpus)
    assert str(out_dir / name) in str(info.value) and "remove it" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert victim.read_bytes() == VICTIM
    assert sorted(p.name for p in out_dir.iterdir()) == [name]  # no temporary file or directory left


def test_a_lock_file_that_is_a_link_is_refused_not_created_at_its_target(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_bytes(VICTIM)
    _dangling_lock(tmp_path / "ids.bin", victim)
    with pytest.raises(TokenFileError, match="ids.bin.lock: is a symbolic link"):
        _tokens(tmp_path / "ids.bin", tmp_path)
    assert not victim.exists() and not (tmp_path / "ids.bin").exists()


def test_the_tokenizer_trains_without_leaving_files_behind(tmp_path, corpus):
    model = train_tokenizer([corpus], tmp_path / "spm", 300, minloglevel=2, input_sentence_size=500)
    assert model == tmp_path / "spm.model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model", "spm.vocab"]


# (errno, what the one line says)
FAILURES = [
    (errno.EFBIG, ["file too large", "ulimit -f"]),
    (errno.EROFS, ["read-only filesystem", "writable filesystem"]),
    (errno.ENOSPC, ["no space left on device", "MB free there now"]),
    (errno.EDQUOT, ["no space left on device"]),
]


@pytest.mark.parametrize(("code", "said"), FAILURES, ids=[errno.errorcode[c] for c, _ in FAILURES])
def test_a_refused_write_is_one_line_naming_the_output(tmp_path, code, said):
    from tokbin.writer import write_failure

    error = write_failure(tmp_path / "ids.bin", OSError(code, os.strerror(code)))
    assert isinstance(error, TokenFileError) and str(tmp_path / "ids.bin") in str(error)
    assert all(s in str(error) for s in said) and len(str(error).splitlines()) == 1
    assert write_failure(tmp_path / "ids.bin", OSError(errno.EIO, "I/O error")) is None


LIMITED = """
import resource, sys
from tokbin.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
sys.exit(main(sys.argv[1:]))
"""


def test_the_file_size_limit_is_one_line_naming_the_output(tmp_path, lossless_model, corpus):
    out = tmp_path / "ids.bin"
    argv = ["encode", "--tokenizer", str(lossless_model), "--input", str(corpus), "--output", str(out), "--quiet"]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LIMITED), *argv], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{out}: file too large" in lines[0] and "8,192 bytes (ulimit -f)" in lines[0], lines[0]
    assert not out.exists() and not list(tmp_path.glob(".ids.bin.*.tmp"))
