"""Check that every `pip install packages/...` line in the READMEs and docs installs what it claims.

A line that installs a package from this checkout must also name the checkout directory of every sibling the package
needs (with the extras it asks for), because our siblings are not on PyPI: a missing one fails to resolve, and under
its import name would resolve to an unrelated project's release. Each `[extra]` must exist in that package's
pyproject.toml. The README lines themselves are run by `nox -s integration` (the top-level one) and by each
`nox -s "package(dist='...')"` (the package's own first line).

Exit 1 with one line per problem; exit 0 with a summary otherwise.

`--run SECTION --workdir DIR` runs instead the ```bash blocks under the README heading `## SECTION` as written, each
as one `bash -euo pipefail` script from DIR (the repository's tools/ and packages/ reached through links there), with
HOME set to a fresh DIR/home: what a newcomer types after the install. `pip install` and `nox` lines are left out
(the caller has installed the packages by the README's own line, and nox would start itself again); every other
command must exit 0; their output goes on to stdout as they run. Exit 1 naming the first block that failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (nox brings it; the version_ranges session installs it)
    import tomli as tomllib
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


def section_blocks(doc: Path, section: str) -> list[str]:
    """The ```bash blocks under the heading `## section` of ``doc`` (up to the next `## ` heading), as text."""
    blocks: list[str] = []
    inside = fenced = False
    current: list[str] = []
    for text in doc.read_text().splitlines():
        if not fenced and text.startswith("## "):
            inside = text[3:].strip() == section
            continue
        if inside and text.lstrip().startswith("```"):
            if fenced:
                blocks.append("\n".join(current) + "\n")
                current = []
            fenced = not fenced and text.strip() == "```bash"
            continue
        if inside and fenced:
            current.append(text)
    return blocks


SKIPPED = re.compile(r"^\s*(?:python3? -m )?(?:pip install|nox)\b")


def run_section(doc: Path, section: str, workdir: Path, timeout_s: float = 1800.0) -> int:
    """Run the blocks of `section` (see the module docstring); 0 when every command exited 0."""
    blocks = section_blocks(doc, section)
    if not blocks:
        print(f"{doc.relative_to(ROOT)}: no ```bash block under '## {section}'", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "home").mkdir(exist_ok=True)
    for name in ("tools", "packages"):
        if not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    # Unbuffered: the commands' stdout and stderr then reach the log in the order they were written.
    env = {**os.environ, "HOME": str(workdir / "home"), "PYTHONUNBUFFERED": "1"}
    for i, block in enumerate(blocks, 1):
        kept = [line for line in block.splitlines() if not SKIPPED.match(line)]
        for line in block.splitlines():
            if SKIPPED.match(line):
                print(f"block {i}: left out (the caller installed the packages): {line.strip()}", flush=True)
        script = "\n".join(kept) + "\n"
        print(f"block {i} of '## {section}':\n{script}", flush=True)
        sys.stdout.flush()
        # The commands' output goes straight on (stderr into stdout, in order): a long block shows its progress.
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env, stdout=sys.stdout,
                                stderr=subprocess.STDOUT, timeout=timeout_s)  # fmt: skip
        if result.returncode != 0:
            print(f"{doc.relative_to(ROOT)}: block {i} of '## {section}' exited {result.returncode}", file=sys.stderr)
            return 1
    print(f"{doc.relative_to(ROOT)}: all {len(blocks)} blocks of '## {section}' ran as written")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", metavar="SECTION", help="run the README section's ```bash blocks as written")
    parser.add_argument("--workdir", type=Path, default=None, help="where --run runs them (a fresh directory)")
    args = parser.parse_args()
    if args.run:
        if args.workdir is None:
            parser.error("--run needs --workdir DIR (a fresh directory to run the commands in)")
        return run_section(ROOT / "README.md", args.run, args.workdir)
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
