"""Every way to install, test, lint and benchmark the toolkit.

`nox -l` lists the sessions. `nox -t ci --parallel 2` is what CI runs (integration, each
package alone, lint, version ranges and install lines, the pins resolved against the public
indexes; two sessions at a time, longest first). `nox -s demo` trains the embedded default.
Sessions reuse their virtual environments (the integration one starts fresh each time, and one
that another Python made is made again); `nox -s clean` removes them all (.nox/).

Sessions name a package by its directory under packages/ (`package(dist='tokbin')`);
four distributions carry the `lmtools-` prefix because their import names belong to
other projects on PyPI (each pyproject.toml says which).

Torch is pinned through a constraints file so that no session pulls a CUDA build
by accident: `tools/constraints-cpu.txt` by default, or the file named by
`LMTOOLS_CONSTRAINTS` (a GPU host points it at its own pins). With the default pins the
sessions add PyTorch's CPU index (`LMTOOLS_TORCH_INDEX`; empty: none) to pip's extra indexes
when it answers, since the CPU build of torch is not on PyPI; `nox -s resolve` checks that the
install sets resolve from PyPI and that index alone, on each of 3.10-3.13 that the machine has.

Sessions run on the Python that runs nox when it is one of 3.10-3.13, else on the newest of
those found on PATH; `nox --force-python 3.12 ...` picks one.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import nox
from nox.virtualenv import VirtualEnv
from packaging.requirements import Requirement

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = os.environ.get("LMTOOLS_CONSTRAINTS", str(ROOT / "tools" / "constraints-cpu.txt"))
sys.path.insert(0, str(ROOT / "tools"))
from check_install_docs import PATH as DIRECTORY  # noqa: E402 - tools/ is not a package
from check_install_docs import directories, install_lines, pyproject, siblings  # noqa: E402

# Directories under packages/, in dependency order: a package comes after every sibling it depends on.
PACKAGES = ["alibi-kernels", "tokbin", "gpumon", "lmcore", "trainloop", "lmtrain"]
# The order the CI sessions start in (`nox -t ci`; the session definitions below follow it): longest first, so that
# with two at a time (--parallel 2) neither slot ends long after the other. Integration (about 25 minutes alone on 2
# cores) and the package sessions of lmtrain (15) and trainloop (25) lead; integration and trainloop are not the first
# pair, so that the second of them to build DeepSpeed's ops takes them from ccache.
CI_ORDER = ["lmtrain", "trainloop", "alibi-kernels", "lmcore", "tokbin", "gpumon"]
# The extras each package's own tests exercise for real (a test hides each module to check the missing-extra error).
TEST_EXTRAS = {
    # parquet: Parquet and zstd input are read through pyarrow; hf: tokenizer.json through `tokenizers`
    "tokbin": ["parquet", "hf"],
    "gpumon": ["plot"],
    "lmcore": ["hf", "gguf", "qlora"],  # the Hugging Face, GGUF and QLoRA tests skip without their libraries
    "trainloop": ["deepspeed", "plot", "tensorboard"],
    # harness: lm-eval and what it brings (datasets, pyarrow, scipy, scikit-learn, ...): 32 s and 556 MB measured;
    # qlora: finetune --method qlora (torchao); eval: eval --prompts (sacrebleu, rouge-score)
    "lmtrain": ["hf", "gguf", "harness", "yaml", "qlora", "eval"],
}
# Distributions with our import names that belong to unrelated projects on PyPI; none may ever be installed.
FOREIGN = ["tokbin", "gpumon", "lmcore", "trainloop"]

# The Python versions the packages support (requires-python >= 3.10) and the pinned torch has wheels for.
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# PyPI's Linux torch is the CUDA build (several GB of NVIDIA libraries, and a Triton pin of its own); the CPU build
# the constraints mean comes from PyTorch's index. Set LMTOOLS_TORCH_INDEX to another index, or to "" for none.
TORCH_INDEX = os.environ.get("LMTOOLS_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
PYPI = "https://pypi.org/simple"
# transformers 5.24+, which the hf extras pin, is released for Python 3.11 and later only (on 3.10 pip finds none).
HF_MIN_PYTHON = (3, 11)
# The extras that sessions on an older Python install without: those that bring transformers. lm-eval (harness) would
# bring 5.20.2, the newest for 3.10, under which 12 of lmtrain's export tests fail (`nox -s transformers_lower_bound`).
# The tests of what they bring skip there, each saying why; so does tokbin's check against transformers.
NEEDS_HF_PYTHON = {"lmcore": {"hf"}, "lmtrain": {"hf", "harness"}}
# The docstring examples that use transformers or lm-eval, left out there too.
HF_DOCTESTS = {
    "lmcore": ["lmcore.hf_import.from_hf", "lmcore.hf_mpt.mpt_config", "lmcore.hf_mpt.to_mpt", "lmcore.hf_mpt.to_peft"],
    "lmtrain": ["lmtrain.export.export_run", "lmtrain.export.hf_tokenizer", "lmtrain.harness.run_lm"],
}


def _session_python() -> str | None:
    """None (nox's own interpreter) when nox runs on one of PYTHONS, else the newest of PYTHONS on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" in PYTHONS:
        return None
    found = [v for v in PYTHONS if shutil.which(f"python{v}")]
    return found[-1] if found else PYTHONS[-1]  # none there: nox says that it found no python3.13


PYTHON = _session_python()

# The CI sessions may run two at a time (`nox -t ci --parallel 2`, nox 2026.8.10 and later): each has a venv, a
# tmp/ and an extension cache of its own. An older nox runs them one at a time.
PARALLEL = {"allow_parallel": True} if "allow_parallel" in inspect.signature(nox.session).parameters else {}

nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# pip reads PIP_CONSTRAINT (and PIP_EXTRA_INDEX_URL, see _torch_index) in every pip it starts, build environments
# included, so a package built from its sdist gets the same pins.
os.environ["PIP_CONSTRAINT"] = CONSTRAINTS
# pip byte-compiles what it installs, and must: where PYTHONDONTWRITEBYTECODE is set (container images often set it)
# Python writes no bytecode of its own, and each process would compile torch's modules afresh. Measured on AMD EPYC,
# 2 vCPUs: `import torch` 4.5-5.1 s with the bytecode, 10.4-11.6 s without; a two-rank DDP test 27 s against 70 s.
os.environ.pop("PIP_NO_COMPILE", None)
os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")

TEST_ENV = {
    "TRITON_INTERPRET": "1",  # Triton kernels run on CPU tensors through the interpreter
    "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
}
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "packaging>=23"]
# pytest-xdist workers per test run (LMTOOLS_TEST_WORKERS; 0, the default: none, the tests in pytest's own process).
# CI runs two sessions at once instead (`nox -t ci --parallel 2`), which also overlaps one session's installs with the
# other's tests. Two workers alone, measured on AMD EPYC, 2 vCPUs, against the sequential runs of a CI log:
# alibi-kernels 284 s -> 197 s, trainloop 1398 s -> 1303 s (1.9 cores busy), integration 1385 s -> 1067 s.
TEST_WORKERS = os.environ.get("LMTOOLS_TEST_WORKERS", "0")
# A test that runs past this many seconds is taken as hung: it fails with every thread's stack, rather than the CI
# run timing out with no word of where.
TEST_TIMEOUT_S = os.environ.get("LMTOOLS_TEST_TIMEOUT_S", "1500")
# What a package's tests compare against, never a dependency of the package: tokbin's chat templates and tokenizer
# files are checked against transformers' own apply_chat_template and AutoTokenizer.
TEST_REFERENCES = {"tokbin": ["transformers>=5.24,<6"]}


def _path(pkg: str, extras: list[str] | None = None) -> str:
    """``packages/<pkg>`` with ``[extra,...]`` when extras are given: what pip takes."""
    return str(PACKAGES_DIR / pkg) + (f"[{','.join(extras)}]" if extras else "")


def _with_siblings(pkg: str, extras: list[str] | None = None) -> list[str]:
    """The directories of `pkg` (with its extras) and of every sibling it needs, in install order."""
    needed = siblings(pkg, frozenset(extras or []))
    return [_path(p, extras if p == pkg else None) for p in PACKAGES if p in needed or p == pkg]


def _documented_install(session: nox.Session, readme: Path, version: tuple[int, int]) -> None:
    """Run the first `pip install packages/...` line of `readme` as written (from the repository root); on a Python
    older than HF_MIN_PYTHON, without the extras it cannot install (NEEDS_HF_PYTHON), saying so."""
    lines = install_lines(readme)
    if not lines:
        session.error(f"{readme.relative_to(ROOT)} has no `pip install packages/...` line in a code block")
    session.log(f"{readme.relative_to(ROOT)}: pip install {shlex.join(lines[0])}")
    line = _installable(lines[0], version)
    if line != lines[0]:
        session.log(f"Python {version[0]}.{version[1]}: pip install {shlex.join(line)} (the hf extra needs "
                    "transformers 5.24+, released for Python 3.11 and later)")  # fmt: skip
    session.chdir(ROOT)
    session.run("python", "-m", "pip", "install", *line)


def _installable(args: list[str], version: tuple[int, int]) -> list[str]:
    """An install line's arguments, less the extras of NEEDS_HF_PYTHON where `version` is older than HF_MIN_PYTHON.

    >>> _installable(["-c", "pins.txt", "packages/lmtrain[deepspeed,hf]"], (3, 10))
    ['-c', 'pins.txt', 'packages/lmtrain[deepspeed]']
    """
    if version >= HF_MIN_PYTHON:
        return args
    kept = []
    for arg in args:
        match = DIRECTORY.match(arg)
        if match and match.group(2):
            extras = [e for e in match.group(2).split(",") if e not in NEEDS_HF_PYTHON.get(match.group(1), set())]
            arg = f"packages/{match.group(1)}" + (f"[{','.join(extras)}]" if extras else "")
        kept.append(arg)
    return kept


def _test_extras(dist: str, version: tuple[int, int]) -> list[str]:
    """The extras `dist`'s tests install on Python `version` (TEST_EXTRAS, less NEEDS_HF_PYTHON's on an older one)."""
    extras = TEST_EXTRAS.get(dist, [])
    return extras if version >= HF_MIN_PYTHON else [e for e in extras if e not in NEEDS_HF_PYTHON.get(dist, set())]


def _test_references(dist: str, version: tuple[int, int]) -> list[str]:
    """What `dist`'s tests compare against on Python `version`: TEST_REFERENCES, all of it transformers 5.24+, which
    an older Python than HF_MIN_PYTHON cannot install."""
    return TEST_REFERENCES.get(dist, []) if version >= HF_MIN_PYTHON else []


@functools.cache
def _answers(index: str, timeout_s: float = 10.0) -> bool:
    """Whether `index` serves torch's page (one request per nox run; an unreachable index would cost pip a retry
    loop of several seconds for every package of every install)."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{index.rstrip('/')}/torch/", method="HEAD"), timeout=timeout_s
        ):
            return True
    except (OSError, ValueError):  # URLError and timeouts are OSErrors
        return False


def _torch_index(session: nox.Session) -> None:
    """With the default CPU pins, add TORCH_INDEX to pip's extra indexes for this and later sessions when it answers
    (torch's CPU build wins over PyPI's CUDA build of the same version: its local label `+cpu` sorts higher). Where
    it does not answer (a machine with a local CPU wheel in pip's find-links and no route there), pip's own
    configuration decides, and the session says so."""
    if not TORCH_INDEX or ("LMTOOLS_CONSTRAINTS" in os.environ and "LMTOOLS_TORCH_INDEX" not in os.environ):
        return
    extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    if TORCH_INDEX in extra:
        return
    if _answers(TORCH_INDEX):
        os.environ["PIP_EXTRA_INDEX_URL"] = " ".join([*extra, TORCH_INDEX])
    else:
        session.log(f"{TORCH_INDEX} does not answer: torch comes from pip's own sources (PyPI's CUDA build does not "
                    "resolve with tools/constraints-cpu.txt; a CPU wheel in find-links does)")  # fmt: skip


def _test_env(session: nox.Session) -> dict[str, str]:
    # DeepSpeed JIT-builds its CPU ops into torch's extension cache, keyed by name only: venvs sharing the default
    # cache rebuild each other's builds (minutes on a busy machine). One cache per venv keeps each build.
    return {**TEST_ENV, "TORCH_EXTENSIONS_DIR": str(Path(session.virtualenv.location) / "torch_extensions")}


# DeepSpeed's ops that the tests JIT-compile on the CPU: async I/O (NVMe offload; needs libaio), pinned host memory, the
# shared-memory collective of two ranks on one host.
DEEPSPEED_OPS = ("AsyncIOBuilder", "PinMemoryBuilder", "ShareMemCommBuilder")


def _deepspeed_ops(session: nox.Session) -> None:
    """Build DeepSpeed's ops into the session's extension cache before its tests (tools/build_deepspeed_ops.py). Two
    sessions build them in CI; a lock in .nox/ makes the second wait for the first, then take every object from
    ccache (.ci/run) rather than compile the same 17 objects beside it (about 7 minutes of both cores)."""
    lock = ROOT / ".nox" / "deepspeed-ops.lock"
    session.run("python", str(ROOT / "tools" / "build_deepspeed_ops.py"), "--lock", str(lock), *DEEPSPEED_OPS,
                env=_test_env(session))  # fmt: skip


def _pytest(session: nox.Session, *paths: str) -> None:
    # nox fails the session on any non-zero exit, pytest's 5 ("no tests collected") included. The slowest tests are
    # listed at the end, so that a CI run that grows shows where. --dist loadgroup keeps the tests marked with one
    # xdist_group on one worker (alibi-kernels' cases that share compiled kernels).
    workers = ["-n", TEST_WORKERS, "--dist", "loadgroup"] if TEST_WORKERS not in ("", "0") else []
    session.run("pytest", "--durations=10", "--durations-min=5", f"--timeout={TEST_TIMEOUT_S}", *workers, *paths,
                *session.posargs, env=_test_env(session))  # fmt: skip


def _doctests(session: nox.Session, dist: str, version: tuple[int, int]) -> None:
    """The docstring examples of the package as installed. --pyargs collects the modules where `import` finds them;
    collecting src/ by path would import a second copy of a package installed non-editable. On a Python older than
    HF_MIN_PYTHON, without those that use transformers (HF_DOCTESTS)."""
    left_out = HF_DOCTESTS.get(dist, []) if version < HF_MIN_PYTHON else []
    if left_out:
        session.log(f"Python {version[0]}.{version[1]}: not running {', '.join(left_out)} (their examples use "
                    "transformers or lm-eval, which the hf and harness extras bring from Python 3.11)")  # fmt: skip
    deselect = ["-k", " and ".join(f"not {name}" for name in left_out)] if left_out else []
    _pytest(session, "--doctest-modules", *deselect, "--pyargs", dist.replace("-", "_"))


def _install_sets(version: tuple[int, int]) -> dict[str, list[str]]:
    """What the demo installs, and the union of what the test sessions install (each package with the extras its
    tests use and those of the README's install line, the test and lint tools): one requirement per directory."""
    extras = {p: set(_test_extras(p, version)) for p in PACKAGES}
    for arg in _installable(install_lines(ROOT / "README.md")[0], version):
        match = DIRECTORY.match(arg)
        if match and match.group(1) in extras:
            extras[match.group(1)] |= set(filter(None, (match.group(2) or "").split(",")))
    tools = [*TEST_TOOLS, "tokenizers", "ruff>=0.6", "mypy>=1.10", "tomli>=1.1; python_version < '3.11'"]
    return {"demo": _demo_requirements(version), "tests": [_path(p, sorted(extras[p])) for p in PACKAGES] + tools}


# What an interpreter runs to say its (major, minor): "3 11".
PRINT_VERSION = "import sys; print(*sys.version_info[:2])"


def _venv_python(session: nox.Session) -> tuple[int, int]:
    """The (major, minor) of the session venv's interpreter (with --no-venv, of the one running nox)."""
    if not session.bin_paths:
        return sys.version_info[0], sys.version_info[1]
    major, minor = session.run("python", "-c", PRINT_VERSION, silent=True).split()
    return int(major), int(minor)


def _demo_requirements(version: tuple[int, int]) -> list[str]:
    """lmtrain with the hf extra, so that the `lmtrain export` the demo prints next works as printed; without it where
    the extra cannot install (Python 3.10)."""
    return _with_siblings("lmtrain", ["hf"] if version >= HF_MIN_PYTHON else None)


def _asked_python(session: nox.Session) -> tuple[int, int]:
    """The (major, minor) of the session venv's Python, after making the venv again where another Python made it. nox
    reuses a venv whatever made it (its optional staleness check compares the venv with itself): `python3.13 -m nox -s
    demo` after a run on 3.12 went on on 3.12, and a Python upgraded under an old .nox/ never reached the sessions."""
    held = _venv_python(session)
    if not session.bin_paths:  # --no-venv
        return held
    named = session.python if isinstance(session.python, str) else f"{sys.version_info[0]}.{sys.version_info[1]}"
    version = re.fullmatch(r"(?:python)?(\d+)\.(\d+)", named)
    if version is None:  # a path or another kind of name: nox's to check
        return held
    asked = (int(version.group(1)), int(version.group(2)))
    if held == asked:
        return held
    venv, where = session.virtualenv, os.path.relpath(session.virtualenv.location, ROOT)
    if not isinstance(venv, VirtualEnv):  # a conda env, say: not ours to remake
        session.error(f"{where} holds Python {held[0]}.{held[1]}, not {named}: run again with --reuse-venv=no")
    session.log(f"{where} holds Python {held[0]}.{held[1]}, this run asks for {named}: making it again")
    venv.reuse_existing = False
    venv.create()
    return asked


def _local_torch_wheels(session: nox.Session, into: Path) -> list[str]:
    """Link into `into` the CPU wheels of the pinned torch for the session's Python that lie in pip's configured
    find-links (PIP_FIND_LINKS, pip.conf): the files PyTorch's CPU index serves, on a machine that cannot reach it."""
    pin = next(
        (ln.split("==")[1].strip() for ln in Path(CONSTRAINTS).read_text().splitlines() if ln.startswith("torch==")),
        None,
    )
    code = "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"
    tag = session.run("python", "-c", code, silent=True).strip()
    config = session.run("python", "-m", "pip", "config", "list", silent=True)
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    places += [
        p for line in config.splitlines() if "find-links=" in line for p in line.split("=", 1)[1].strip("'\"").split()
    ]
    found = []
    for place in dict.fromkeys(places):
        for wheel in sorted(Path(place.removeprefix("file://")).glob(f"torch-{pin}+cpu-{tag}-*.whl")) if pin else []:
            (into / wheel.name).unlink(missing_ok=True)
            (into / wheel.name).symlink_to(wheel)
            found.append(str(wheel))
    return found


def _holds_ours(session: nox.Session) -> bool:
    """Whether the session's venv holds one of the packages already (a venv reused from an earlier run)."""
    if not session.bin_paths:  # --no-venv: whatever the interpreter holds
        return True
    names = {name.replace("-", "_") for name in directories()}  # dist-info names spell them with underscores
    found = Path(session.virtualenv.location).glob("lib*/python*/site-packages/*.dist-info")
    return any(d.name.split("-")[0].lower() in names for d in found)


@nox.session(python=PYTHON, tags=["ci"], reuse_venv=False, **PARALLEL)
def integration(session: nox.Session) -> None:
    """In a fresh venv, the README's install line as written (on Python 3.10 without the hf extra, which it says):
    all six import, `lmtrain --help` runs, and no unrelated project's distribution under one of our import names got
    in; then integration_tests/ (with DeepSpeed), among them the README's "First hour" commands as written
    (test_readme.py, tools/check_install_docs.py --run)."""
    _torch_index(session)
    _documented_install(session, ROOT / "README.md", _venv_python(session))
    listed = session.run("python", "-m", "pip", "list", "--format=freeze", silent=True)
    foreign = [line for line in listed.splitlines() if line.split("==")[0].lower() in FOREIGN]
    if foreign:
        session.error(f"an unrelated project's distribution got installed: {', '.join(foreign)}")
    session.run("python", "-c", "import alibi_kernels, gpumon, lmcore, lmtrain, tokbin, trainloop")
    session.run("lmtrain", "--help", silent=True)
    # The two-rank tests need DeepSpeed (in the extra's range) whether or not the README's line brought it.
    deepspeed = pyproject("trainloop")["project"]["optional-dependencies"]["deepspeed"]
    # The fine-tuning workflow test scores generations (eval --prompts: sacrebleu, rouge-score).
    scorers = pyproject("lmtrain")["project"]["optional-dependencies"]["eval"]
    # nox: test_noxfile.py runs the demo session on what this one installed.
    session.install(*deepspeed, *scorers, *TEST_TOOLS, "nox>=2024.4")
    _deepspeed_ops(session)
    _pytest(session, "integration_tests")


@nox.session(python=PYTHON, tags=["ci"], **PARALLEL)
@nox.parametrize("dist", CI_ORDER)
def package(session: nox.Session, dist: str) -> None:
    """One package installed alone by its README's install line (plus the extras its tests use); its own tests and
    its doctests."""
    version = _asked_python(session)
    _torch_index(session)
    # A reused venv already holds this version: reinstall so that it gets today's code (a new venv holds nothing).
    if _holds_ours(session):
        session.install("--force-reinstall", "--no-deps", *_with_siblings(dist))
    _documented_install(session, PACKAGES_DIR / dist / "README.md", version)
    extras = _test_extras(dist, version)
    session.install(*_with_siblings(dist, extras), *TEST_TOOLS, *_test_references(dist, version))
    if "deepspeed" in extras:
        _deepspeed_ops(session)
    session.chdir(PACKAGES_DIR / dist)
    _pytest(session, "tests")
    _doctests(session, dist, version)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package installed editable in one venv; all unit tests and doctests (the fast inner loop)."""
    version = _asked_python(session)
    _torch_index(session)
    editable = [arg for p in PACKAGES for arg in ("-e", _path(p, _test_extras(p, version)))]
    session.install(*editable, *TEST_TOOLS, "tokenizers")
    for dist in PACKAGES:
        session.chdir(PACKAGES_DIR / dist)
        _pytest(session, "tests")
        _doctests(session, dist, version)


@nox.session(python=PYTHON, tags=["ci"], **PARALLEL)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree; every table of measured figures in the docs names its
    command (one the tree still has), commit, load and processor (tools/check_doc_figures.py); mypy (mypy.ini) over
    the six packages, installed with their dependencies so that the types they use are checked too."""
    _asked_python(session)
    _torch_index(session)
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_doc_figures.py")
    session.install("mypy>=1.10", *[arg for p in PACKAGES for arg in ("-e", _path(p))])
    session.run("mypy", "--config-file", "mypy.ini", *[f"packages/{p}/src" for p in PACKAGES])


@nox.session(python=PYTHON, tags=["ci"], **PARALLEL)
def version_ranges(session: nox.Session) -> None:
    """Every sibling version range admits the sibling's current version; every documented `pip install packages/...`
    line names the directories of all the siblings it needs and only extras that exist."""
    _asked_python(session)
    session.install("packaging>=23", "tomli>=1.1; python_version < '3.11'")
    session.run("python", "tools/check_version_ranges.py")
    session.run("python", "tools/check_install_docs.py")


@nox.session(python=PYTHON, tags=["ci"], **PARALLEL)
def resolve(session: nox.Session) -> None:
    """pip's resolver, as a dry run that installs nothing, on the demo's install set and on the union of the tests'
    ones, with this file's constraints, from PyPI alone plus torch's CPU build: a pin that cannot resolve on a stock
    machine fails here. pip's configuration and environment are ignored (--isolated and no config file). Torch's
    CPU build comes from TORCH_INDEX or, where that does not answer, from the same wheel in pip's find-links; the
    session says which, and what resolved. With other pins (LMTOOLS_CONSTRAINTS and no LMTOOLS_TORCH_INDEX, as in
    _torch_index), everything comes from PyPI.

    Each Python of PYTHONS that this machine has (_interpreter) resolves the tests' set too, the session's pip running
    on it (pip --python): markers, in the constraints and in what the packages require, are the target's own, which
    pip's --python-version would not give. Where torch's CPU build comes from a local wheel, the other Pythons get that
    wheel's requirements (_metadata_wheels). The session names the Pythons it could not find."""
    version = _asked_python(session)
    named = "{}.{}".format(*version)
    found = {v: _interpreter(v) for v in PYTHONS if v != named}
    missing = [v for v, exe in found.items() if exe is None]
    if missing:
        session.log(f"not checked: Python {', '.join(missing)} (neither python3.X on PATH nor among pyenv's versions)")
    pythons = {named: "", **{v: exe for v, exe in found.items() if exe}}  # the session's own first, as is
    tmp = Path(session.create_tmp())
    if "LMTOOLS_CONSTRAINTS" in os.environ and "LMTOOLS_TORCH_INDEX" not in os.environ:
        session.log(f"{CONSTRAINTS}: resolving from PyPI alone")
        source = []
    elif TORCH_INDEX and _answers(TORCH_INDEX):
        source = ["--extra-index-url", TORCH_INDEX]
    else:
        standin = tmp / "torch-cpu-wheels"
        standin.mkdir(exist_ok=True)
        wheels = _local_torch_wheels(session, standin)
        if not wheels:
            session.error(f"cannot check: {TORCH_INDEX or 'LMTOOLS_TORCH_INDEX'} does not answer and pip's find-links "
                          "hold no CPU wheel of the pinned torch for this Python")  # fmt: skip
        session.log(f"{TORCH_INDEX} does not answer: torch's CPU build from {', '.join(wheels)}, the rest from PyPI")
        others = [f"cp{v.replace('.', '')}" for v in pythons if v != named]
        if others:
            made = _metadata_wheels(Path(wheels[0]), others, standin)
            session.log(f"for the other Pythons, the requirements of {Path(wheels[0]).name}: {', '.join(made)}")
        source = ["--find-links", str(standin)]
    session.install("pip>=22.3")  # --python
    session.chdir(ROOT)
    for python, exe in pythons.items():
        target = ["--python", exe] if exe else []
        sets = _install_sets(_version(python))
        if exe:  # another Python: the tests' set alone, which holds the demo's (a solution of it is one of the demo's)
            del sets["demo"]
        for name, requirements in sets.items():
            report = tmp / f"resolve-{name}-{python}.json"
            # No config file: pip reads PIP_CONFIG_FILE even under --isolated, which skips only the user's files.
            session.run("python", "-m", "pip", *target, "install", "--isolated", "--dry-run", "--ignore-installed",
                        "--quiet", "--index-url", PYPI, *source, "-c", CONSTRAINTS, "--report", str(report),
                        *requirements, env={"PIP_CONFIG_FILE": os.devnull})  # fmt: skip
            chosen = {
                i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]
            }
            pinned = ", ".join(f"{n} {chosen[n]}" for n in ("torch", "triton", "deepspeed") if n in chosen)
            session.log(f"Python {python}, {name}: {len(chosen)} distributions resolve ({pinned})")


def _version(python: str) -> tuple[int, int]:
    """`"3.10"` as `(3, 10)`."""
    major, minor = python.split(".")
    return int(major), int(minor)


def _interpreter(python: str) -> str | None:
    """A Python `python` ("3.10") that runs: python3.10 on PATH, else the newest 3.10.x of pyenv's versions (whose
    shims answer only for the versions pyenv has selected); None where neither does."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    pyenv = sorted(versions.glob(f"{python}.*/bin/python{python}"), key=lambda p: _patch(p.parent.parent.name))
    for exe in [shutil.which(f"python{python}"), *map(str, reversed(pyenv))]:
        if exe is None:
            continue
        try:
            ran = subprocess.run([exe, "-c", PRINT_VERSION], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ran.returncode == 0 and ran.stdout.split() == python.split("."):
            return exe
    return None


def _patch(name: str) -> int:
    """The patch number of a pyenv version directory ("3.10.13": 13; -1 for "3.10-dev" and the like)."""
    last = name.rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else -1


def _metadata_wheels(source: Path, tags: list[str], into: Path) -> list[str]:
    """For a dry run on other Pythons: a wheel per CPython tag in `tags` that holds only the .dist-info METADATA of
    `source` (a cp311 wheel of torch's CPU build, say) under that tag, and no code; the names written.

    Nothing installs from them: pip's --dry-run reads a wheel's metadata only. PyTorch builds one source for every
    Python, and PyPI's torch 2.13.0 Linux wheels for cp310 to cp314 carry the same requirements (checked)."""
    with zipfile.ZipFile(source) as whl:
        metadata = next(n for n in whl.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = whl.read(metadata)
    info = metadata.split("/")[0]
    name, version, *_, platform = source.name.removesuffix(".whl").split("-")
    made = []
    for tag in tags:
        target = into / f"{name}-{version}-{tag}-{tag}-{platform}.whl"
        header = f"Wheel-Version: 1.0\nGenerator: noxfile.py\nRoot-Is-Purelib: false\nTag: {tag}-{tag}-{platform}\n"
        with zipfile.ZipFile(target, "w") as whl:
            whl.writestr(f"{info}/METADATA", text)
            whl.writestr(f"{info}/WHEEL", header)
            whl.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
        made.append(target.name)
    return made


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: `lmtrain demo` trains a small model on an embedded corpus, on CPU. The hf extra comes with it, so
    that the `lmtrain export` the demo prints next works as printed; on Python 3.10, where it cannot install, the demo
    runs without it."""
    version = _asked_python(session)
    _torch_index(session)
    if version < HF_MIN_PYTHON:
        session.log(f"Python {version[0]}.{version[1]}: without the hf extra (transformers 5.24+ needs Python 3.11); "
                    "the demo runs, and its export loads in transformers from Python 3.11")  # fmt: skip
    session.install(*_demo_requirements(version))
    # lmtrain gets the PATH of the shell that ran nox, not the session's (nox puts this venv's bin/ first, whatever
    # env= says, hence `env`): the commands it prints next then name the lmtrain that shell reaches, the full path
    # here, and run as printed there.
    # With --no-venv --no-install (integration_tests/test_noxfile.py), the lmtrain of the Python running nox.
    bin_dir = Path(session.bin) if session.bin_paths else Path(sys.executable).parent
    lmtrain = str(bin_dir / "lmtrain")
    session.run("env", f"PATH={os.environ.get('PATH', '')}", lmtrain, "demo", *session.posargs, external=True)
    session.log(f"lmtrain is in {lmtrain} (source {bin_dir / 'activate'} to put it on PATH); `nox -s clean` removes "
                "this and every other nox venv")  # fmt: skip


@nox.session(python=False)
def clean(session: nox.Session) -> None:
    """Remove .nox/, the virtual environments the sessions made and reuse (several GB after `nox -t ci`: torch,
    DeepSpeed and their builds in each), saying how much that freed. CI runs it at the end (.ci/run)."""
    import shutil

    venvs = ROOT / ".nox"
    if not venvs.is_dir():
        session.log(f"{venvs}: nothing to remove")
        return
    size = sum(p.lstat().st_size for p in venvs.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(venvs)
    session.log(
        f"removed {venvs} ({size / 2**30:.1f} GiB)" if size >= 2**30 else f"removed {venvs} ({size / 2**20:.0f} MiB)"
    )


@nox.session(python=PYTHON)
def deepspeed_lower_bound(session: nox.Session) -> None:
    """trainloop's DeepSpeed tests on the oldest DeepSpeed its `deepspeed` extra admits, or on the version given
    (`nox -s deepspeed_lower_bound -- 0.17.1`, to try a wider range). DeepSpeed builds from its sdist: minutes.

    Not in CI: CI tests the pinned version (tools/constraints-cpu.txt).
    """
    _asked_python(session)
    _torch_index(session)
    req = next(Requirement(r) for r in pyproject("trainloop")["project"]["optional-dependencies"]["deepspeed"])
    version = session.posargs[0] if session.posargs else next(s.version for s in req.specifier if s.operator == ">=")
    # The shared constraints pin DeepSpeed to the tested release: use them without that line.
    constraints = Path(session.create_tmp()) / "constraints-without-deepspeed.txt"
    kept = [ln for ln in Path(CONSTRAINTS).read_text().splitlines() if not ln.strip().startswith("deepspeed")]
    constraints.write_text("\n".join(kept) + "\n")
    env = {"PIP_CONSTRAINT": str(constraints)}
    session.install("--force-reinstall", "--no-deps", _path("trainloop"), env=env)
    session.install(_path("trainloop", TEST_EXTRAS["trainloop"]), f"deepspeed=={version}", *TEST_TOOLS, env=env)
    session.chdir(PACKAGES_DIR / "trainloop")
    # test_extras checks that the installed DeepSpeed lies in the declared range: below it, that test fails too.
    session.run("pytest", "tests/test_deepspeed.py", "tests/test_extras.py", env=_test_env(session))


# The test files that compare against transformers or PEFT, or load what an export wrote with them.
HF_TESTS = {
    "tokbin": ["tests/test_chat_template.py", "tests/test_text_tokenizer.py"],
    "lmcore": ["tests/test_extras.py", "tests/test_finetune_memory.py", "tests/test_gguf_llama.py",
               "tests/test_hf_export.py", "tests/test_hf_export_llama.py", "tests/test_hf_import.py",
               "tests/test_qlora.py", "tests/test_rope.py"],
    "lmtrain": ["tests/test_after_training.py", "tests/test_base_model.py", "tests/test_demo_base.py",
                "tests/test_doctor_from.py", "tests/test_export.py", "tests/test_finetune.py", "tests/test_progress.py",
                "tests/test_qlora_fsdp.py"],
}  # fmt: skip


@nox.session(python=PYTHON)
def transformers_lower_bound(session: nox.Session) -> None:
    """The tests that use transformers, on the oldest release lmcore's `hf` extra admits, or on the version given
    (`nox -s transformers_lower_bound -- 5.20.2`: the newest for Python 3.10, under which lmtrain's export of a
    SentencePiece tokenizer fails, the document-start id missing: 12 of 100 lmtrain tests failed).

    Not in CI: CI tests the newest release pip finds.
    """
    _asked_python(session)
    _torch_index(session)
    req = Requirement(pyproject("lmcore")["project"]["optional-dependencies"]["hf"][0])  # transformers
    version = session.posargs[0] if session.posargs else next(s.version for s in req.specifier if s.operator == ">=")
    session.install(*[arg for p in PACKAGES for arg in ("-e", _path(p, TEST_EXTRAS.get(p)))], *TEST_TOOLS)
    # Below the extra's range pip installs it all the same, with a warning that lmcore asks for another.
    session.install(f"transformers=={version}")
    session.run("python", "-c", "import transformers; print('transformers', transformers.__version__)")
    for dist, files in HF_TESTS.items():
        session.chdir(PACKAGES_DIR / dist)
        session.run("pytest", *files, env=_test_env(session))


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every package benchmark and the headline TinyShakespeare benchmark; print their tables."""
    _asked_python(session)
    _torch_index(session)
    session.install(*_with_siblings("lmtrain", ["deepspeed"]), "tokenizers")
    scripts = sorted(PACKAGES_DIR.glob("*/benchmarks/bench_*.py"))
    if not session.posargs or "shakespeare" in session.posargs:
        scripts.append(ROOT / "tools" / "bench_shakespeare.py")
    if "finetune" in session.posargs:  # `nox -s bench -- finetune`: LoRA against PEFT + transformers.Trainer
        session.install(*_with_siblings("lmtrain", ["hf", "qlora", "eval"]))
        scripts.append(ROOT / "tools" / "bench_finetune.py")
    for script in scripts:
        if session.posargs and not any(a in script.name or a in str(script) for a in session.posargs):
            continue
        session.log(f"benchmark: {script.relative_to(ROOT)}")
        session.run("python", str(script), env={"DS_ACCELERATOR": TEST_ENV["DS_ACCELERATOR"]})
