"""The noxfile as the README's commands use it. `python3 -m nox -s demo` as far as the noxfile decides it: the session
run with --no-venv --no-install on the packages this environment holds (making nox's venv and pip's install are
theirs), from a shell whose PATH does not reach lmtrain, and the commands the demo prints next run as printed in that
shell, also after a second demo into the same directory. And a session's venv that another Python made is made again
on the Python nox runs on."""

from __future__ import annotations

import json
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


def _version(python: str) -> str | None:
    """'3.12' for an interpreter that runs, else None."""
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
    noxfile = _noxfile()
    other = next(filter(None, (noxfile._interpreter(v) for v in noxfile.PYTHONS if v != here)), None)
    if other is None:
        pytest.skip(f"no Python 3.10-3.13 but {here} on PATH or among pyenv's versions to make the stale venv with")
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


def _python(path: Path, prints: str, status: int = 0) -> None:
    """An executable at `path` that stands for a Python: prints `prints` and exits with `status`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {prints}\nexit {status}\n")
    path.chmod(0o755)


def test_the_resolve_session_finds_each_python_that_runs(tmp_path, monkeypatch):
    noxfile = _noxfile()
    shims, versions = tmp_path / "shims", tmp_path / "pyenv" / "versions"
    monkeypatch.setenv("PATH", str(shims))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    # pyenv's shim of a version it has not selected exits 127; the newest patch release that runs is taken.
    _python(shims / "python3.12", "pyenv: python3.12: command not found", 127)
    _python(versions / "3.12.9" / "bin" / "python3.12", "3 12")
    _python(versions / "3.12.10" / "bin" / "python3.12", "3 12")
    _python(versions / "3.12-dev" / "bin" / "python3.12", "3 12")
    assert noxfile._interpreter("3.12") == str(versions / "3.12.10" / "bin" / "python3.12")
    _python(versions / "3.12.10" / "bin" / "python3.12", "3 12", 1)
    assert noxfile._interpreter("3.12") == str(versions / "3.12.9" / "bin" / "python3.12")
    # One on PATH that runs comes first; one that is another version under the name is not taken.
    _python(shims / "python3.12", "3 12")
    assert noxfile._interpreter("3.12") == str(shims / "python3.12")
    _python(shims / "python3.13", "3 11")
    assert noxfile._interpreter("3.13") is None and noxfile._interpreter("3.10") is None


def test_the_other_pythons_get_the_local_torch_wheels_requirements(tmp_path):
    import zipfile
    from urllib.parse import unquote

    from packaging.utils import parse_wheel_filename

    metadata = "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\nRequires-Dist: filelock\n"
    source = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(source, "w") as whl:
        whl.writestr("torch/__init__.py", "")
        whl.writestr("torch-2.13.0+cpu.dist-info/METADATA", metadata)
    into = tmp_path / "out"
    into.mkdir()
    made = _noxfile()._metadata_wheels(source, ["cp310", "cp313"], into)
    assert made == [f"torch-2.13.0+cpu-{t}-{t}-manylinux_2_28_x86_64.whl" for t in ("cp310", "cp313")]
    for name in made:
        (tag,) = parse_wheel_filename(name)[3]
        with zipfile.ZipFile(into / name) as whl:
            assert whl.read("torch-2.13.0+cpu.dist-info/METADATA").decode() == metadata
            assert (
                f"Tag: {tag.interpreter}-{tag.abi}-{tag.platform}"
                in whl.read("torch-2.13.0+cpu.dist-info/WHEEL").decode()
            )
            assert not [n for n in whl.namelist() if not n.startswith("torch-2.13.0+cpu.dist-info/")]
    # pip takes one for its Python, as a dry run does: the tag and the requirements it reads.
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index", "--quiet",
                    "--find-links", str(into), "--python-version", "3.13", "--only-binary=:all:", "--no-deps",
                    "--target", str(tmp_path / "target"),
                    "--report", str(report), "torch==2.13.0"], check=True, capture_output=True, timeout=300,
                   env={**child_env(), "PIP_CONFIG_FILE": os.devnull})  # fmt: skip
    (chosen,) = json.loads(report.read_text())["install"]
    assert unquote(chosen["download_info"]["url"]).endswith(f"/{made[1]}") and chosen["metadata"]["requires_dist"] == [
        "filelock"
    ]


def _noxfile():
    """noxfile.py as a module (nox itself loads it the same way, by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
