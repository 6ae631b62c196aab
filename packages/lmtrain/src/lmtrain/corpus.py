"""A corpus every machine with Python has: the standard library's own source, outside its test suites.

`lmtrain demo`, the examples (lmtrain.examples) and the instruction pairs of the fine-tuning demo
(lmtrain.instructions) read it, so nothing is downloaded.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

from lmtrain.errors import LmtrainError

# Enough source for a few minutes of cpu-small (several epochs would need hours); a stride over the sorted
# files keeps the sample spread over the whole library.
DEMO_CORPUS_BYTES = 2_500_000
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files outside test suites and installed packages, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (_SKIP_PARTS & set(p.relative_to(root).parts))]
    if not files:
        raise LmtrainError(f"no Python source under {root}: this Python ships without its standard library source")
    return sorted(files)


def build_corpus(out_file: Path, max_bytes: int = DEMO_CORPUS_BYTES) -> dict[str, int]:
    """Write about `max_bytes` of stdlib source into `out_file`, each file under a `# file:` line.

    Example:
        >>> import tempfile
        >>> out = tempfile.TemporaryDirectory()
        >>> corpus = Path(out.name) / "corpus.txt"
        >>> info = build_corpus(corpus, 1_000_000)
        >>> 0 < info["files"] < info["available_files"], info["bytes"] == corpus.stat().st_size
        (True, True)
        >>> corpus.read_text(encoding="utf-8").startswith("# file: ")
        True
        >>> out.cleanup()
    """
    files = stdlib_sources()
    sizes = [p.stat().st_size for p in files]
    stride = max(1, math.ceil(sum(sizes) / max_bytes))
    root = Path(sysconfig.get_paths()["stdlib"])
    written = used = 0
    with open(out_file, "w", encoding="utf-8") as out:
        for path in files[::stride]:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few files are in other encodings or unreadable: skip them
            chunk = f"# file: {path.relative_to(root)}\n{text}\n"
            out.write(chunk)
            written += len(chunk.encode("utf-8"))
            used += 1
            if written >= max_bytes:
                break
    return {"files": used, "bytes": written, "available_files": len(files)}
