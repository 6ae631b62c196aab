"""Every table of measured figures in the docs names the command that made it, the commit and the machine's load.

A table is "of measured figures" when one of its cells holds a number with a unit of time, rate, size or ratio
(`12.3 ms`, `4.50 MB/s`, `1.22x`, `68%`, `7.9 GiB`, ...) and its section (the text from the heading above it to
the paragraph after it) speaks of measuring: "measured", "benchmark", "bench_", "timed", "ran". Such a section
must hold:
- a command: a code span or block that runs something (`python ...`, `nox ...`, `lmtrain ...`, `torchrun ...`,
  `pytest ...`, `bash ...`, a `*.py` script);
- a commit: a 7-40 digit hexadecimal id;
- the load: the word "load" (the load average the figures were measured at) or "computed" (figures computed, not
  timed, such as memory estimates).

A table whose numbers are not measurements (an API table, default settings) is marked by the line
`<!-- not measured: REASON -->` right above it. Prints one line per table that lacks one of them (file, line, what
is missing) and exits 1; exits 0 when none does.

    python tools/check_doc_figures.py [FILE.md ...]      # default: docs/*.md, README.md, packages/*/README.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = r"(?:ms|us|µs|s|min|MB/s|GB/s|MiB|GiB|MB|GB|KB|tokens/s|GFLOP/s|TFLOP/s|x|%)"
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?{UNIT}(?![\w/])")
COMMAND = re.compile(r"\b(?:python3?|nox|lmtrain|torchrun|pytest|bash|tokbin|lmcore-estimate)\b|\w\.py\b")
COMMIT = re.compile(r"(?<![\w.])[0-9a-f]{7,40}(?![\w.])")
LOAD = re.compile(r"\bload\b|\bcomputed\b", re.IGNORECASE)
MEASURING = re.compile(r"\bmeasured\b|\bbenchmarks?\b|bench_|\btimed\b|\bran\b", re.IGNORECASE)
CODE = re.compile(r"`([^`]+)`")  # a code span may wrap onto the next line
EXEMPT = re.compile(r"^<!-- not measured: .+ -->$")


def default_files() -> list[Path]:
    return sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")])


def sections(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line indices of each heading's section; code blocks' '#' lines are not headings."""
    starts, fenced = [0], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            starts.append(i)
    ends = starts[1:] + [len(lines)]
    return list(zip(starts, ends, strict=True))


def code_text(lines: list[str]) -> str:
    """The code spans and fenced blocks of ``lines``, joined: where a command can be named."""
    out, prose, fenced = [], [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
            continue
        (out if fenced else prose).append(line)
    return "\n".join(out + CODE.findall("\n".join(prose)))


def tables(lines: list[str], first: int, last: int) -> list[int]:
    """Indices of the header line of each markdown table in lines[first:last] (outside code blocks)."""
    found, fenced = [], False
    for i in range(first, last):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif (
            not fenced
            and lines[i].lstrip().startswith("|")
            and i + 1 < last
            and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])
            and (i == first or not lines[i - 1].lstrip().startswith("|"))
        ):
            found.append(i)
    return found


def problems(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for first, last in sections(lines):
        for start in tables(lines, first, last):
            end = start
            while end < last and lines[end].lstrip().startswith("|"):
                end += 1
            body = "\n".join(CODE.sub("", line) for line in lines[start + 2 : end])
            if not FIGURE.search(body) or (start > 0 and EXEMPT.match(lines[start - 1].strip())):
                continue
            # What names the figures: the section up to the table and the paragraph right after it.
            after = end
            while after < last and lines[after].strip():
                after += 1
            context = lines[first:start] + lines[start:end] + lines[end:after]
            text = "\n".join(context)
            if not MEASURING.search(text):
                continue
            missing = [
                what
                for what, ok in (
                    ("a command", COMMAND.search(code_text(context))),
                    ("a commit", COMMIT.search(text)),
                    ("the load (or 'computed')", LOAD.search(text)),
                )
                if not ok
            ]
            if missing:
                rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{rel}:{start + 1}: a table of figures without {', '.join(missing)} in its section")
    return out


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or default_files()
    found = [p for f in files for p in problems(f)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
