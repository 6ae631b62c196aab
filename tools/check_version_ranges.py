"""Check that each sibling requirement in packages/*/pyproject.toml admits the sibling's current version.

Requirements of the extras count too (`lmtrain[deepspeed]` needs `lmtools-trainloop[deepspeed]`). Siblings are
matched by canonical distribution name, which is not always the directory's (four carry the `lmtools-` prefix);
a requirement on a bare import name whose distribution is renamed (`tokbin`, another project's on PyPI) is an error.

Exit 1 with one line per mismatch; exit 0 with a summary otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (nox brings it; the version_ranges session installs it)
    import tomli as tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def current_versions() -> dict[str, tuple[str, str]]:
    """Canonical distribution name -> (version, directory under packages/)."""
    versions = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        name = meta["project"]["name"]
        version_file = pyproject.parent / meta["tool"]["hatch"]["version"]["path"]
        match = re.search(r'__version__\s*=\s*"([^"]+)"', version_file.read_text())
        if match is None:
            sys.exit(f'{version_file}: no __version__ = "..." line')
        versions[canonicalize_name(name)] = (match.group(1), pyproject.parent.name)
    return versions


def renamed() -> dict[str, str]:
    """Canonical import name -> our distribution name, where the two differ (the import name is taken on PyPI)."""
    out = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        for package in meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
            if canonicalize_name(Path(package).name) != canonicalize_name(meta["project"]["name"]):
                out[canonicalize_name(Path(package).name)] = meta["project"]["name"]
    return out


def main() -> int:
    versions, foreign = current_versions(), renamed()
    problems, checked = [], 0
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        lines = project.get("dependencies", []) + sum(project.get("optional-dependencies", {}).values(), [])
        for line in lines:
            req = Requirement(line)
            if canonicalize_name(req.name) in foreign:
                ours = foreign[canonicalize_name(req.name)]
                problems.append(f"{pyproject}: requires {req.name}, an unrelated project on PyPI; ours is {ours}")
            if canonicalize_name(req.name) not in versions:
                continue
            checked += 1
            version, directory = versions[canonicalize_name(req.name)]
            if req.url:
                problems.append(f"{pyproject}: {req.name} is named by URL/path; use a version range")
            elif not req.specifier.contains(version, prereleases=True):
                problems.append(f"{pyproject}: requires {req} but packages/{directory} is at {version}")
    return report(problems, f"version ranges OK: {checked} sibling requirements across {len(versions)} packages")


def report(problems: list[str], ok: str) -> int:
    """Print each problem (exit status 1), or the one-line summary ``ok`` (exit status 0)."""
    print("\n".join(problems) if problems else ok)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
