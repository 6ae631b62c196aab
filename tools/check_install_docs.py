"""Check that every `pip install packages/...` line in the READMEs and docs installs what it claims.

A line that installs a package from this checkout must also name the checkout directory of every sibling the package
needs (with the extras it asks for), because our siblings are not on PyPI: a missing one fails to resolve, and under
its import name would resolve to an unrelated project's release. Each `[extra]` must exist in that package's
pyproject.toml. The README lines themselves are run by `nox -s integration` (the top-level one) and by each
`nox -s "package(dist='...')"` (the package's own first line).

Exit 1 with one line per problem; exit 0 with a summary otherwise.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import tomllib
from check_version_ranges import report  # tools/ is the script's directory, hence on sys.path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
DOCS = [ROOT / "README.md", *sorted(PACKAGES_DIR.glob("*/README.md")), *sorted((ROOT / "docs").glob("*.md"))]
LINE = re.compile(r"^\s*(?:python3? -m )?pip install (.*packages/.*?)\s*(?:#.*)?$")
PATH = re.compile(r"^(?:\./)?packages/([A-Za-z0-9_.-]+)/?(?:\[([A-Za-z0-9_,.-]+)\])?$")


def pyproject(directory: str) -> dict:
    return tomllib.loads((PACKAGES_DIR / directory / "pyproject.toml").read_text())


def directories() -> dict[str, str]:
    """Canonical distribution name -> directory under packages/."""
    return {canonicalize_name(pyproject(d.name)["project"]["name"]): d.name for d in sorted(PACKAGES_DIR.iterdir())
            if (d / "pyproject.toml").is_file()}  # fmt: skip


def siblings(directory: str, extras: frozenset[str] = frozenset(), dirs: dict[str, str] | None = None) -> set[str]:
    """The sibling directories that ``directory[extras]`` requires, transitively (through their extras too)."""
    dirs = directories() if dirs is None else dirs
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(directory, frozenset(extras))]
    while todo:
        current, current_extras = todo.pop()
        if (current, current_extras) in seen:
            continue
        seen.add((current, current_extras))
        project = pyproject(current)["project"]
        lines = list(project.get("dependencies", []))
        for extra in current_extras:
            lines += project.get("optional-dependencies", {}).get(extra, [])
        for line in lines:
            req = Requirement(line)
            if canonicalize_name(req.name) in dirs:
                todo.append((dirs[canonicalize_name(req.name)], frozenset(req.extras)))
    return {d for d, _ in seen} - {directory}


def install_lines(doc: Path) -> list[list[str]]:
    """The arguments of each `pip install` line in a fenced code block of ``doc`` that names a packages/ path."""
    found, fenced = [], False
    for text in doc.read_text().splitlines():
        if text.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = LINE.match(text) if fenced else None
        if match:
            found.append(shlex.split(match.group(1)))
    return found


def check_line(args: list[str], dirs: dict[str, str]) -> list[str]:
    """Problems with one line's arguments (empty when it installs everything it needs from the checkout)."""
    named: dict[str, set[str]] = {}
    problems = []
    for arg in args:
        match = PATH.match(arg)
        if match is None:
            continue  # a PyPI requirement or an option
        directory, extras = match.group(1), set(filter(None, (match.group(2) or "").split(",")))
        if directory not in dirs.values():
            problems.append(f"{arg}: no package directory packages/{directory}")
            continue
        known = set(pyproject(directory)["project"].get("optional-dependencies", {}))
        problems += [f"{arg}: packages/{directory} has no extra [{e}] (it has {sorted(known)})" for e in extras - known]
        named.setdefault(directory, set()).update(extras & known)
    required = set().union(*(siblings(d, frozenset(e), dirs) for d, e in named.items()))
    missing = sorted(required - set(named))
    if missing:
        problems.append("also needs " + " ".join(f"packages/{d}" for d in missing) + " (siblings are not on PyPI)")
    return problems


def main() -> int:
    dirs = directories()
    problems, checked = [], 0
    for doc in DOCS:
        for args in install_lines(doc):
            checked += 1
            where = f"{doc.relative_to(ROOT)}: pip install {shlex.join(args)}"
            problems += [f"{where}: {p}" for p in check_line(args, dirs)]
    return report(problems, f"install lines OK: {checked} lines in {len(DOCS)} documents name every sibling they need")


if __name__ == "__main__":
    sys.exit(main())
