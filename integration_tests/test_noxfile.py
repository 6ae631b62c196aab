"""The noxfile as the README's commands use it. `python3 -m nox -s demo` as far as the noxfile decides it: the session
run with --no-venv --no-install on the packages this environment holds (making nox's venv and pip's install are
theirs), from a shell whose PATH does not reach lmtrain, and the commands the demo prints next run as printed in that
shell, also after a second demo into the same directory. And a session's venv that another Python made is made again
on the Python nox runs on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
# The integration session installs the hf extra (export) where it can: Python 3.11 and later (noxfile.py HF_MIN_PYTHON).
EXPORTS = sys.version_info >= (3, 11)


def test_the_nox_demo_session_prints_next_commands_that_run_as_printed(tmp_path):
    here = Path(sys.executable).parent
    env = child_env()
    # The user's shell: PATH without this environment's bin/, so a bare `lmtrain` would not be found.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p and Path(p).resolve() != here.resolve())
    assert shutil.which("lmtrain", path=env["PATH"]) is None
    out = tmp_path / "demo"
    nox = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "--no-venv", "--no-install", "-s", "demo",
           "--", "--time-budget", "6", "--out", str(out)]  # fmt: skip
    result = subprocess.run(nox, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "Session demo was successful" in log and f"lmtrain is in {here / 'lmtrain'}" in log
    assert "lmtrain: run finished" in result.stdout and (out / "run" / "loss.png").is_file()
    printed = result.stdout[result.stdout.index("next:\n") :].splitlines()[1:]
    follow = [line.strip() for line in printed if line.startswith("  ")]
    verbs = ("generate", "eval", "export") if EXPORTS else ("generate", "eval")
    commands = [line for line in follow if not line.startswith("#")]
    assert [line.split()[:2] for line in commands] == [[str((here / "lmtrain").resolve()), v] for v in verbs], printed
    if not EXPORTS:  # in place of the export line, a comment saying what export needs
        assert follow[-1].startswith("# export to Hugging Face formats needs transformers"), printed
    for line in follow:
        ran = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, f"{line}\n{ran.stdout[-2000:]}\n{ran.stderr[-2000:]}"
    if not EXPORTS:
        return
    assert (out / "hf" / "config.json").is_file()
    # The demo again into the same directory redoes the run; the export line it prints replaces the first export.
    again = subprocess.run([str(here / "lmtrain"), "demo", "--time-budget", "3", "--out", str(out)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (export,) = [line.strip() for line in again.stdout.splitlines() if line.startswith("  ") and " export " in line]
    ran = subprocess.run(export, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"{export}\n{ran.stderr[-2000:]}"


def _version(python: str | None) -> str | None:
    """'3.12' for an interpreter that runs, else None (a pyenv shim of a version not selected exits 127)."""
    if python is None:
        return None
    ran = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2], sep='.')"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    return ran.stdout.strip() if ran.returncode == 0 else None


@pytest.fixture
def short_dir():
    """A directory with a short path: nox hashes a venv's name where the path would pass 87 characters, as pytest's
    tmp_path under a pytest-xdist worker can, and then would not find the venv the test made."""
    made = Path(tempfile.mkdtemp(prefix="nox-"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def test_a_venv_another_python_made_is_made_again(short_dir):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [(v, str(p)) for v in ("3.10", "3.11", "3.12", "3.13") if v != here
             for p in [shutil.which(f"python{v}"), *sorted(pyenv.glob(f"{v}.*/bin/python{v}"))] if p]  # fmt: skip
    other = next((python for v, python in found if _version(python) == v), None)
    if other is None:
        pytest.skip(f"no Python 3.10-3.13 but {here} on PATH or under {pyenv} to make the stale venv with")
    venv = short_dir / "envs" / "version_ranges"
    # A venv as nox makes it (virtualenv, nox's default backend), by another Python: nox itself would reuse it.
    subprocess.run([sys.executable, "-m", "virtualenv", "-p", other, str(venv)], check=True, timeout=300,
                   capture_output=True)  # fmt: skip
    held = _version(str(venv / "bin" / "python"))
    nox = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "--envdir", str(venv.parent), "-s",
           "version_ranges"]  # fmt: skip
    result = subprocess.run(nox, env=child_env(), capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert re.search(rf"version_ranges holds Python {held}, this run asks for {here}: making it again", log), log
    assert _version(str(venv / "bin" / "python")) == here


def test_an_older_python_installs_without_the_extras_that_need_transformers():
    noxfile = _noxfile()
    line = ["-c", "pins.txt", "packages/tokbin[hf]", "packages/lmcore[hf,gguf]", "packages/lmtrain[deepspeed,hf]"]
    assert noxfile._installable(line, (3, 11)) == line
    assert noxfile._installable(line, (3, 10)) == ["-c", "pins.txt", "packages/tokbin[hf]", "packages/lmcore[gguf]",
                                                  "packages/lmtrain[deepspeed]"]  # fmt: skip
    # tokbin's hf extra is the tokenizers library, which 3.10 has; lm-eval would bring an older transformers.
    assert "hf" in noxfile._test_extras("tokbin", (3, 10)) and noxfile._test_references("tokbin", (3, 10)) == []
    assert not {"hf", "harness"} & set(noxfile._test_extras("lmtrain", (3, 10)))
    assert {"hf", "harness"} <= set(noxfile._test_extras("lmtrain", (3, 12)))
    older = noxfile._install_sets((3, 10))
    assert not [r for r in older["tests"] + older["demo"] if re.search(r"(lmcore|lmtrain)\[.*\b(hf|harness)\b", r)]
    assert any(re.search(r"lmtrain\[.*\bharness\b", r) for r in noxfile._install_sets((3, 11))["tests"])


def _noxfile():
    """noxfile.py as a module (nox itself loads it the same way, by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
