"""Every table of measured figures in the docs names the command that made it, the commit, the machine's load and its
processor, and that command still exists in the tree.

A table is "of measured figures" when one of its cells holds a number with a unit of time, rate, size or ratio
(`12.3 ms`, `4.50 MB/s`, `1.22x`, `68%`, `7.9 GiB`, ...) and its section (the text from the heading above it to
the paragraph after it) speaks of measuring: "measured", "benchmark", "bench_", "timed", "ran". Such a section
must hold:
- a command: a code span or block that runs something (`python ...`, `nox ...`, `lmtrain ...`, `torchrun ...`,
  `pytest ...`, `bash ...`, a `*.py` script);
- a commit: a 7-40 digit hexadecimal id;
- the load: the word "load" (the load average the figures were measured at) or "computed" (figures computed, not
  timed, such as memory estimates);
- the processor the figures were measured on, unless they were computed (no "load"): a CPU model (`Xeon`, `EPYC`,
  `Ryzen`, `Core i7`, `Zen 5`, `Graviton`, `Apple M2`, ...) or a GPU's (`H200`, `A100`, `RTX 3090`, ...), since a
  timing taken on one processor is no figure for another. Figures measured before the model was recorded say
  "CPU not recorded" instead, so that they do not read as general; new ones name it (`lscpu`);
and every command of the section that runs a script of the tree (`python tools/x.py`, `bash tools/x.sh`, `pytest
path`, `nox -s SESSION`, `lmtrain SUBCOMMAND`, `tokbin ...`, `gpumon ...`) must name a script, session or
subcommand that still exists (a script path is looked up from the repository root, the document's directory and
each package's directory, or as the tail of any path in the tree).

A table whose numbers are not measurements (an API table, default settings) is marked by the line
`<!-- not measured: REASON -->` right above it. Prints one line per table that lacks one of them (file, line, what
is missing) and exits 1; exits 0 when none does.

    python tools/check_doc_figures.py [FILE.md ...]      # default: docs/*.md, README.md, packages/*/README.md
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = r"(?:ms|us|µs|s|min|MB/s|GB/s|MiB|GiB|MB|GB|KB|tokens/s|GFLOP/s|TFLOP/s|x|%)"
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?{UNIT}(?![\w/])")
COMMAND = re.compile(r"\b(?:python3?|nox|lmtrain|torchrun|pytest|bash|tokbin|lmcore-estimate)\b|\w\.py\b")
COMMIT = re.compile(r"(?<![\w.])[0-9a-f]{7,40}(?![\w.])")
LOAD = re.compile(r"\bload\b|\bcomputed\b", re.IGNORECASE)
MEASURING = re.compile(r"\bmeasured\b|\bbenchmarks?\b|bench_|\btimed\b|\bran\b", re.IGNORECASE)
PROCESSOR = re.compile(
    r"\b(?:Xeon|EPYC|Opteron|Ryzen|Threadripper|Core\s+i[3579]|Core\s+Ultra|Zen\s?\d|Graviton\d?|Neoverse|Apple\s+M\d|"
    r"[AHBL]\d{2,3}\b|RTX\s?\d{4}|GTX\s?\d{4}|Tesla|Radeon|Instinct|MI\d{3}|CPU\s+not\s+recorded)"
)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SCRIPT = re.compile(r"^[\w./-]+\.(?:py|sh)$")
CLIS = ("lmtrain", "tokbin", "gpumon")  # console scripts with subcommands (argparse's add_parser)
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


def command_text(lines: list[str]) -> str:
    """The code spans and the shell blocks (```bash, sh, shell, console) of ``lines``: where commands are run; other
    blocks hold output or code."""
    out, prose, shell, fenced = [], [], False, False
    for line in lines:
        if line.startswith("```"):
            fenced, shell = not fenced, line[3:].strip() in ("bash", "sh", "shell", "console")
            continue
        if not fenced:
            prose.append(line)
        elif shell:
            out.append(line)
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


@functools.cache
def tree_files() -> frozenset[str]:
    """Every file under the repository root (posix paths relative to it), hidden directories left out."""
    found = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in ("__pycache__", "node_modules")]
        rel = Path(directory).relative_to(ROOT)
        found += [(rel / name).as_posix() for name in files]
    return frozenset(found)


@functools.cache
def sessions() -> frozenset[str]:
    """The nox sessions noxfile.py defines (each a function taking `session`)."""
    return frozenset(re.findall(r"^def (\w+)\(session\b", (ROOT / "noxfile.py").read_text(), re.MULTILINE))


@functools.cache
def subcommands() -> frozenset[str]:
    """The subcommands the packages' command lines register (`sub.add_parser("name", ...)`)."""
    names: set[str] = set()
    for source in ROOT.glob("packages/*/src/**/*.py"):
        names.update(re.findall(r"add_parser\(\s*[\"']([\w-]+)[\"']", source.read_text(encoding="utf-8")))
    return frozenset(names)


def script_exists(script: str, doc: Path, cd: str | None) -> bool:
    """Whether `script` names a file of the tree: from the root, the document's directory, a `cd` directory, a
    package's directory, or as the tail of any path."""
    script = script.removeprefix("./")
    bases = [ROOT, doc.parent, *ROOT.glob("packages/*")]
    if cd:
        bases = [ROOT / cd, doc.parent / cd, *bases]
    if any((base / script).is_file() for base in bases):
        return True
    return any(f == script or f.endswith("/" + script) for f in tree_files())


def missing_commands(code: str, doc: Path) -> list[str]:
    """The commands in `code` (lines and spans) that run a script, nox session or subcommand the tree no longer has."""
    gone = []
    for line in code.replace("\\\n", " ").splitlines():
        cd = None
        for segment in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(segment.strip().removeprefix("$ "))
            except ValueError:
                words = segment.split()
            while words and ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            if not words:
                continue
            program, args = words[0], words[1:]
            if program == "cd" and args:
                cd = args[0]
            elif program == "torchrun" and "lmtrain" in args:
                program, args = "lmtrain", args[args.index("lmtrain") + 1 :]
            if program in ("python", "python3", "bash", "torchrun", "pytest"):
                scripts = [a.split("::")[0] for a in args if SCRIPT.match(a.split("::")[0])]
                if program != "pytest":  # the program runs its first script; later ones are its arguments
                    scripts = scripts[:1] if args and not args[0].startswith("-m") else []
                gone += [f"`{s}`" for s in scripts if not script_exists(s, doc, cd)]
            elif program == "nox" and ("-s" in args or "--session" in args):
                flag = "-s" if "-s" in args else "--session"
                name = args[args.index(flag) + 1].split("(")[0] if args.index(flag) + 1 < len(args) else ""
                if name and name not in sessions():
                    gone.append(f"nox session `{name}`")
            elif program in CLIS:
                named = next((a for a in args if not a.startswith("-")), None)
                if named and named not in subcommands():
                    gone.append(f"`{program} {named}`")
    return gone


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
            code = code_text(context)
            timed = re.search(r"\bload\b", text, re.IGNORECASE)  # computed figures need no processor
            missing = [
                what
                for what, ok in (
                    ("a command", COMMAND.search(code)),
                    ("a commit", COMMIT.search(text)),
                    ("the load (or 'computed')", LOAD.search(text)),
                    ("the CPU (or GPU) model", PROCESSOR.search(text) or not timed),
                )
                if not ok
            ]
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            if missing:
                out.append(f"{rel}:{start + 1}: a table of figures without {', '.join(missing)} in its section")
            gone = missing_commands(command_text(context), path)
            if gone:
                out.append(
                    f"{rel}:{start + 1}: a table of figures whose command is gone from the tree: {', '.join(gone)}"
                )
    return out


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or default_files()
    found = [p for f in files for p in problems(f)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
