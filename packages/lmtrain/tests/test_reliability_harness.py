"""`lmtrain eval --tasks`: a task the harness cannot build (an unknown output_type, a missing data file), a --limit
that is no number and a negative --num-fewshot are one line with exit status 2, and nothing is written."""

from __future__ import annotations

import json

import pytest
from trained_runs import tiny_run

from lmtrain.cli import main

pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    (root / "docs.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x\n" * 8}) + "\n")
    for name, data, output_type in [("rel_good", root / "docs.jsonl", "loglikelihood_rolling"),
                                    ("rel_bad_type", root / "docs.jsonl", "bogus_type"),
                                    ("rel_no_data", root / "missing.jsonl", "loglikelihood_rolling")]:  # fmt: skip
        (root / f"{name}.yaml").write_text(TASK.format(name=name, data=data, output_type=output_type))
    return root


# (case, task, extra flags, words of the one-line error)
BAD = [
    ("unknown output_type", "rel_bad_type", [], ["a task could not be built", "bogus_type", "fix its YAML"]),
    ("missing data file", "rel_no_data", [], ["a task could not be built", "missing.jsonl"]),
    ("limit nan", "rel_good", ["--limit", "nan"], ["--limit must be a finite number > 0, got nan"]),
    ("limit inf", "rel_good", ["--limit", "inf"], ["--limit must be a finite number > 0, got inf"]),
    ("num-fewshot -1", "rel_good", ["--num-fewshot", "-1"], ["--num-fewshot must be >= 0", "got -1"]),
]


@pytest.mark.parametrize(("task", "flags", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tasks_and_flags_are_one_line_and_write_nothing(run, tasks, tmp_path, capsys, task, flags, words):
    out = tmp_path / "results"
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    argv = ["eval", "--run", str(run), "--tasks", task, "--include-path", str(tasks), "--out", str(out), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmtrain eval: error: "), err
    assert all(w in err[0] for w in words), err[0]
    assert not out.exists() and sorted(p.name for p in run.iterdir()) == before
