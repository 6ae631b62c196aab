"""How the commands the toolkit prints reach this `lmtrain` from the user's shell."""

from __future__ import annotations

from pathlib import Path


def lmtrain_command() -> str:
    """How the user reaches this `lmtrain` from their shell: ``lmtrain`` when that name on PATH is this one, else
    the path of the script that is running, or of this environment's script (a nox or virtual environment that is
    not activated), else ``python -m lmtrain`` with this interpreter.
    """
    import shlex
    import shutil
    import sys

    running = Path(sys.argv[0]) if sys.argv and Path(sys.argv[0]).name == "lmtrain" else None
    beside = Path(sys.executable).parent / "lmtrain"
    found = shutil.which("lmtrain")
    for script in (running, beside):
        if script is not None and script.is_file():
            if found is not None and Path(found).resolve() == script.resolve():
                return "lmtrain"
            return shlex.quote(str(script.resolve()))
    return f"{shlex.quote(sys.executable)} -m lmtrain"


def export_next(command: str, run: str, out: str, *, replace: bool = False) -> str:
    """The `export` line of a "next" list (`run` and `out` already quoted): the command, or, where transformers
    cannot be imported here, a shell comment saying what it needs, so that every line of the list runs as printed.
    `replace`: `out` holds an earlier export the command must replace (--force), e.g. a demo's of the run it redid.

    Example:
        >>> line = export_next("lmtrain", "runs/a", "DIR")
        >>> line == "lmtrain export --run runs/a --out DIR" or line.startswith("# export to Hugging Face formats")
        True
    """
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        from lmcore.extras import extra_hint

        return f"# export to Hugging Face formats needs transformers: {extra_hint('hf', 'lmtrain')}"
    return f"{command} export --run {run} --out {out}" + (" --force" if replace else "")


def kit_file(name: str) -> str:
    """``tools/cluster-3090/NAME`` as the user reaches it from the current directory: relative where the checkout
    this lmtrain runs from lies below it, else the absolute path; a wheel installed without its checkout gets the
    path inside the repository, said as such.

    Example:
        >>> "cluster-3090/env.sh" in kit_file("env.sh")  # a path from here, or the one inside the repository
        True
    """
    import os
    import shlex

    path = Path(__file__).resolve().parents[4] / "tools" / "cluster-3090" / name  # packages/lmtrain/src/lmtrain/
    if not path.is_file():
        return f"tools/cluster-3090/{name} of the repository"
    try:
        shown = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        shown = str(path)
    return shlex.quote(str(path) if shown.startswith("..") else shown)
