"""Instruction pairs from the standard library's source, no download: a function's signature and docstring as the
prompt, its body as the answer, grouped by module (so a held-out split holds out whole modules).

The embedded default of the fine-tuning workflow (`lmtrain demo --finetune`, tools/bench_finetune.py).
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from pathlib import Path

from lmtrain.errors import LmtrainError

PROMPT = "Complete the function.\n{head}"
MAX_PAIR_CHARS = 900  # prompt + answer: about 250-400 tokens of a small vocabulary, inside a 512 context


def function_pairs(path: Path, max_chars: int = MAX_PAIR_CHARS) -> list[tuple[str, str]]:
    """(prompt, answer) of every function in the file ``path`` that has a docstring and a body after it.

    Example:
        >>> import tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> src = Path(work.name) / "m.py"
        >>> _ = src.write_text("def add(a, b):\\n    'Sum of a and b.'\\n    return a + b\\n")
        >>> function_pairs(src)
        [("Complete the function.\\ndef add(a, b):\\n    'Sum of a and b.'\\n", '    return a + b\\n')]
        >>> work.cleanup()
    """
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if node.end_lineno is None or doc.end_lineno is None or node.decorator_list:
            continue
        head = "".join(lines[node.lineno - 1 : doc.end_lineno])
        body = "".join(lines[doc.end_lineno : node.end_lineno])
        indent = len(head) - len(head.lstrip())
        if indent:  # methods: shift the whole function to the left margin
            head = "".join(line[indent:] for line in head.splitlines(keepends=True))
            body = "".join(line[indent:] if line.strip() else line for line in body.splitlines(keepends=True))
        if body.strip() and len(head) + len(body) <= max_chars:
            pairs.append((PROMPT.format(head=head), body))
    return pairs


def write_instructions(
    out: str | os.PathLike, max_pairs: int = 2000, max_chars: int = MAX_PAIR_CHARS
) -> dict[str, int]:
    """Write up to ``max_pairs`` instruction pairs from the standard library (modules in sorted order, spread over
    the library by a stride) to the JSONL file ``out``: ``{"prompt", "response", "group": module}`` per line.

    Example:
        >>> import json, tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> info = write_instructions(f"{work.name}/pairs.jsonl", max_pairs=20)
        >>> info["pairs"], sorted(json.loads(open(f"{work.name}/pairs.jsonl").readline()))
        (20, ['group', 'prompt', 'response'])
        >>> work.cleanup()
    """
    from lmtrain.corpus import stdlib_sources

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    stride = max(1, len(files) // max(1, max_pairs // 4))
    written = modules = 0
    with open(out, "w", encoding="utf-8") as f:
        for start in range(stride):
            for path in files[start::stride]:
                pairs = function_pairs(path, max_chars)[:8]  # a few per module: many modules, not a few big ones
                if not pairs:
                    continue
                modules += 1
                group = str(path.relative_to(root))
                for prompt, answer in pairs:
                    f.write(json.dumps({"prompt": prompt, "response": answer, "group": group}) + "\n")
                    written += 1
                    if written >= max_pairs:
                        return {"pairs": written, "modules": modules}
    if not written:
        raise LmtrainError(f"no documented functions found under {root}: no instruction pairs to write")
    return {"pairs": written, "modules": modules}
