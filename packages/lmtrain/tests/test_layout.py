"""The package's layout: no lmtrain module imports one that (through others) imports it back, at the top of the file
or inside a function, and no module imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import lmtrain

PACKAGE = Path(lmtrain.__file__).parent


def imports() -> dict[str, set[tuple[str, str]]]:
    """{module: {(imported module, imported name)}} for every import of an lmtrain module, wherever it stands."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    found: dict[str, set[tuple[str, str]]] = {}
    for path in PACKAGE.glob("*.py"):
        edges = found.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lmtrain":
                parts = node.module.split(".")
                for alias in node.names:
                    target, name = (parts[1], alias.name) if len(parts) > 1 else (alias.name, "")
                    if target in modules:
                        edges.add((target, name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "lmtrain" and len(parts) > 1 and parts[1] in modules:
                        edges.add((parts[1], ""))
    return found


def test_no_module_imports_itself_back() -> None:
    graph = {module: {target for target, _ in edges if target != module} for module, edges in imports().items()}
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in sorted(graph[module]):
                if target == start:
                    circles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_private_name_crosses_modules() -> None:
    private = sorted(
        f"{module} imports {target}.{name}"
        for module, edges in imports().items()
        for target, name in edges
        if target != module and name.startswith("_") and not name.startswith("__")
    )
    assert not private, "\n".join(private)
