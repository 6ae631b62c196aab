"""The docs' figure check (tools/check_doc_figures.py, run by the lint session): the docs pass it, and a table of
measured figures without its command, commit, load or processor, or whose script, nox session or subcommand is gone
from the tree, fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import check_doc_figures  # noqa: E402 - tools/ is not a package

TABLE = "| run | step ms |\n| --- | --- |\n| 1 | 12.5 ms |\n"


def test_the_docs_name_the_command_commit_load_and_processor_of_every_measured_table():
    assert [p for f in check_doc_figures.default_files() for p in check_doc_figures.problems(f)] == []


SCRIPT = "`python tools/check_doc_figures.py`"  # a script of the tree


@pytest.mark.parametrize(
    ("section", "missing"),
    [
        (f"Measured with {SCRIPT} at commit 1a2b3c4d on a 2-vCPU Intel Xeon, load average 2.1:\n\n", None),
        ("Measured at commit 1a2b3c4d on an AMD EPYC, load average 2.1:\n\n", "a command"),
        (f"Measured with {SCRIPT} on an AMD EPYC, load average 2.1:\n\n", "a commit"),
        (f"Measured with {SCRIPT} at commit 1a2b3c4d on an AMD EPYC:\n\n", "the load"),
        (f"Measured with {SCRIPT} at commit 1a2b3c4d, load average 2.1:\n\n", "the CPU (or GPU) model"),
        (f"Measured with {SCRIPT} at commit 1a2b3c4d, load average 2.1, CPU not\nrecorded:\n\n", None),
        (
            "Measured on one H200 with `python tools/bench_gone.py`, commit 1a2b3c4d, load 2.1:\n\n",
            "`tools/bench_gone.py`",
        ),
        ("Measured with `nox -s bench_gone` on a Xeon at commit 1a2b3c4d, load 2.1:\n\n", "nox session `bench_gone`"),
        ("Measured with `lmtrain trian --data d` on a Xeon at commit 1a2b3c4d, load 2.1:\n\n", "`lmtrain trian`"),
        ("Measured with `lmtrain train --data d` and `nox -s bench` on a Xeon at commit 1a2b3c4d, load 2.1:\n\n", None),
        ("<!-- not measured: defaults -->\n", None),
    ],
)
def test_a_measured_table_without_its_provenance_or_with_a_gone_command_fails(tmp_path, section, missing):
    doc = tmp_path / "doc.md"
    doc.write_text("# Speed\n\n" + section + TABLE + "\nMeasured on 2 cores.\n")
    found = check_doc_figures.problems(doc)
    if missing is None:
        assert found == []
    else:
        assert len(found) == 1 and missing in found[0] and "doc.md:" in found[0], found
