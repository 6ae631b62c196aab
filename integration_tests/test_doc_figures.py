"""The docs' figure check (tools/check_doc_figures.py, run by the lint session): the docs pass it, and a table of
measured figures without its command, commit or load fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import check_doc_figures  # noqa: E402 - tools/ is not a package

TABLE = "| run | step ms |\n| --- | --- |\n| 1 | 12.5 ms |\n"


def test_the_docs_name_the_command_commit_and_load_of_every_measured_table():
    assert [p for f in check_doc_figures.default_files() for p in check_doc_figures.problems(f)] == []


@pytest.mark.parametrize(
    ("section", "missing"),
    [
        ("Measured with `python bench.py` at commit 1a2b3c4d, load average 2.1:\n\n", None),
        ("Measured at commit 1a2b3c4d, load average 2.1:\n\n", "a command"),
        ("Measured with `python bench.py`, load average 2.1:\n\n", "a commit"),
        ("Measured with `python bench.py` at commit 1a2b3c4d:\n\n", "the load"),
        ("<!-- not measured: defaults -->\n", None),
    ],
)
def test_a_measured_table_without_its_provenance_fails(tmp_path, section, missing):
    doc = tmp_path / "doc.md"
    doc.write_text("# Speed\n\n" + section + TABLE + "\nMeasured on 2 cores.\n")
    found = check_doc_figures.problems(doc)
    if missing is None:
        assert found == []
    else:
        assert len(found) == 1 and missing in found[0] and "doc.md:" in found[0]
