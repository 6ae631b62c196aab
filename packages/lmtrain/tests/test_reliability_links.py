"""No write of a command goes through a link: a `.lmtrain.lock` that is a hard link (which O_NOFOLLOW does not stop)
or a symbolic link is refused before it is emptied, for every command that takes the lock; `prepare --out D` whose
outputs (tokenizer.model and tokenizer.vocab, which SentencePiece writes itself, the token files, val.txt, meta.json)
are links is refused before any work and leaves the linked file as it was."""

from __future__ import annotations

import os
import shutil

import pytest
from trained_runs import tiny_run

from lmtrain.cli import main
from lmtrain.errors import LmtrainError
from lmtrain.run_lock import LOCK_FILE, DirectoryLock

VICTIM = "a user's own file: keep me\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def _hard(target, victim):
    os.link(victim, target)


def _sym(target, victim):
    target.symlink_to(victim)


def _fifo(target, victim):
    os.mkfifo(target)


LINKS = [
    ("hard link", _hard, "hard links"),
    ("symbolic link", _sym, "symbolic link"),
    ("fifo", _fifo, "not a regular file"),
]


@pytest.mark.parametrize(("make", "said"), [k[1:] for k in LINKS], ids=[k[0] for k in LINKS])
def test_the_lock_is_never_emptied_through_a_link(tmp_path, make, said):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    (tmp_path / "out").mkdir()
    make(tmp_path / "out" / LOCK_FILE, victim)
    with pytest.raises(LmtrainError, match=said) as info, DirectoryLock(tmp_path / "out", "lmtrain train"):
        pass
    assert len(str(info.value).splitlines()) == 1 and "remove" in str(info.value)
    assert victim.read_text() == VICTIM


def _commands(run, data, out):
    ft_data = out.parent / "chat.jsonl"
    ft_data.write_text('{"prompt": "def f(x):\\n", "response": "    return x\\n"}\n' * 20)
    return {
        "prepare": ["prepare", "--text", str(data / "val.txt"), "--out", str(out), "--vocab-size", "400", "--quiet"],
        "train --resume": ["train", "--config", str(run / "run.json"), "--out", str(out), "--resume",
                           "--max-steps", "6", "--no-progress"],
        "train --overwrite": ["train", "--config", str(run / "run.json"), "--out", str(out), "--overwrite",
                              "--max-steps", "2", "--no-progress"],
        "finetune --resume": ["finetune", "--from", str(run), "--data", str(ft_data), "--out", str(out), "--resume",
                              "--max-steps", "1", "--seq-len", "64", "--no-progress"],
    }  # fmt: skip


COMMANDS = ["prepare", "train --resume", "train --overwrite", "finetune --resume"]


@pytest.mark.parametrize("make", [k[1] for k in LINKS[:2]], ids=[k[0] for k in LINKS[:2]])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_locks_refuses_a_linked_lock(run, tmp_path, capsys, command, make):
    out = tmp_path / "out"
    shutil.copytree(run, out) if command.startswith("train") else out.mkdir()
    (out / LOCK_FILE).unlink(missing_ok=True)
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    make(out / LOCK_FILE, victim)
    data = run.parent / "data"
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(_commands(run, data, out)[command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"its lock file {LOCK_FILE}" in err[0], err
    assert victim.read_text() == VICTIM
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written


@pytest.mark.parametrize("make", [k[1] for k in LINKS[:2]], ids=[k[0] for k in LINKS[:2]])
@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.vocab", "train.bin", "val.txt", "meta.json"])
def test_prepare_never_writes_an_output_through_a_link(run, tmp_path, capsys, name, make):
    out = tmp_path / "data"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    make(out / name, victim)
    capsys.readouterr()
    argv = ["prepare", "--text", str(run.parent / "data" / "val.txt"), "--out", str(out), "--vocab-size", "400",
            "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / name}: " in err[0] and "remove it" in err[0], err
    assert victim.read_text() == VICTIM
    assert sorted(p.name for p in out.iterdir()) == sorted([name, LOCK_FILE])  # nothing else left behind
