"""Every way to install, test, lint and benchmark the toolkit.

`nox -l` lists the sessions. `nox -t ci` is what CI runs (lint, version ranges,
each package alone, integration). `nox -s demo` trains the embedded default.

Torch is pinned through a constraints file so that no session pulls a CUDA build
by accident: `tools/constraints-cpu.txt` by default, or the file named by
`LMTOOLS_CONSTRAINTS` (a GPU host points it at its own pins).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = os.environ.get("LMTOOLS_CONSTRAINTS", str(ROOT / "tools" / "constraints-cpu.txt"))

# Dependency order: a package comes after every sibling it depends on.
PACKAGES = ["alibi-kernels", "tokbin", "gpumon", "lmcore", "trainloop", "lmtrain"]

nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# pip reads PIP_CONSTRAINT in every pip it starts, build environments included, so
# an sdist that builds against torch (DeepSpeed) also gets the pinned CPU build.
os.environ["PIP_CONSTRAINT"] = CONSTRAINTS
os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")

TEST_ENV = {
    "TRITON_INTERPRET": "1",  # Triton kernels run on CPU tensors through the interpreter
    "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
}
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.2"]


def _pyproject(dist: str) -> dict:
    return tomllib.loads((PACKAGES_DIR / dist / "pyproject.toml").read_text())


def _siblings(dist: str, seen: set[str] | None = None) -> list[str]:
    """The sibling distributions `dist` depends on, transitively, in install order."""
    seen = set() if seen is None else seen
    for req in _pyproject(dist)["project"].get("dependencies", []):
        name = req.split(";")[0].split("[")[0]
        for op in "<>=!~ ":
            name = name.split(op)[0]
        if name in PACKAGES and name not in seen:
            seen.add(name)
            _siblings(name, seen)
    return [p for p in PACKAGES if p in seen]


def _pytest(session: nox.Session, *paths: str) -> None:
    # nox fails the session on any non-zero exit, pytest's 5 ("no tests collected") included.
    session.run("pytest", *paths, *session.posargs, env=TEST_ENV)


@nox.session(python="3.11", tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11", tags=["ci"])
def version_ranges(session: nox.Session) -> None:
    """Check that every sibling version range admits the sibling's current version."""
    session.install("packaging>=23")
    session.run("python", "tools/check_version_ranges.py")


@nox.session(python="3.11", tags=["ci"])
@nox.parametrize("dist", PACKAGES)
def package(session: nox.Session, dist: str) -> None:
    """One package installed alone (non-editable, plus the siblings it declares); its own tests."""
    local = [str(PACKAGES_DIR / s) for s in _siblings(dist)]
    session.install("--force-reinstall", "--no-deps", str(PACKAGES_DIR / dist), *local)
    session.install(str(PACKAGES_DIR / dist), *local, *TEST_TOOLS)
    session.chdir(PACKAGES_DIR / dist)
    _pytest(session, "tests")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every package installed editable in one venv; all unit tests (the fast inner loop)."""
    editable = [arg for p in PACKAGES for arg in ("-e", str(PACKAGES_DIR / p))]
    session.install(*editable, *TEST_TOOLS, "tokenizers")
    for dist in PACKAGES:
        session.chdir(PACKAGES_DIR / dist)
        _pytest(session, "tests")


@nox.session(python="3.11", tags=["ci"])
def integration(session: nox.Session) -> None:
    """Build wheels of all six packages, install them, run integration_tests/."""
    wheels = Path(session.create_tmp()) / "wheels"
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), *[str(PACKAGES_DIR / p) for p in PACKAGES]
    )
    built = sorted(str(w) for w in wheels.glob("*.whl"))
    session.install("--force-reinstall", "--no-deps", *built)
    session.install(*built, *TEST_TOOLS)
    session.chdir(ROOT)
    _pytest(session, "integration_tests")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: `lmtrain demo` trains a small model on an embedded corpus, on CPU."""
    session.install(*[str(PACKAGES_DIR / p) for p in PACKAGES])
    session.run("lmtrain", "demo", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run every package benchmark and the headline TinyShakespeare benchmark; print their tables."""
    session.install(*[str(PACKAGES_DIR / p) for p in PACKAGES], "tokenizers")
    scripts = sorted(PACKAGES_DIR.glob("*/benchmarks/bench_*.py"))
    if not session.posargs or "shakespeare" in session.posargs:
        scripts.append(ROOT / "tools" / "bench_shakespeare.py")
    for script in scripts:
        if session.posargs and not any(a in script.name or a in str(script) for a in session.posargs):
            continue
        session.log(f"benchmark: {script.relative_to(ROOT)}")
        session.run("python", str(script), env={"DS_ACCELERATOR": TEST_ENV["DS_ACCELERATOR"]})
