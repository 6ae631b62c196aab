"""Check that each sibling requirement in packages/*/pyproject.toml admits the sibling's current version.

Exit 1 with one line per mismatch; exit 0 with a summary otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def current_versions() -> dict[str, str]:
    versions = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        name = meta["project"]["name"]
        version_file = pyproject.parent / meta["tool"]["hatch"]["version"]["path"]
        match = re.search(r'__version__\s*=\s*"([^"]+)"', version_file.read_text())
        if match is None:
            sys.exit(f'{version_file}: no __version__ = "..." line')
        versions[name] = match.group(1)
    return versions


def main() -> int:
    versions = current_versions()
    problems, checked = [], 0
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        for line in meta["project"].get("dependencies", []):
            req = Requirement(line)
            if req.name not in versions:
                continue
            checked += 1
            if req.url:
                problems.append(f"{pyproject}: {req.name} is named by URL/path; use a version range")
            elif not req.specifier.contains(versions[req.name], prereleases=True):
                problems.append(f"{pyproject}: requires {req} but packages/{req.name} is at {versions[req.name]}")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"version ranges OK: {checked} sibling requirements across {len(versions)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
