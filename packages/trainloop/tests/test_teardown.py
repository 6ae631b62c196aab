"""Collectives and teardown on 2 gloo ranks: sums and JSON broadcasts through trainloop's buffers, and the process
group destroyed by Trainer.close() or, for a script that never closes its Trainer, before the interpreter exits."""

import json

import pytest
from launch import run


def _reports(run_dir) -> list[dict]:
    return [json.loads(line) for f in sorted(run_dir.glob("reports_*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_process_group_is_destroyed_before_the_interpreter_exits(tmp_path, mode):
    run("collectives.py", {"run_dir": str(tmp_path), "mode": mode}, nproc=2)
    reports = _reports(tmp_path)
    for rank in (0, 1):
        mine = [r for r in reports if r["rank"] == rank]
        first = mine[0]
        assert first["summed"] == [3.0, 10.0]  # (1 + 2), (0 + 10): summed over both ranks
        assert first["received_ok"] is True  # a document of several chunks, as rank 0 sent it
        assert first["collectives"] > 5 and first["not_buffers"] == 0 and first["pickled"] == []
        states = {r["when"]: r["initialised"] for r in mine if "when" in r}
        assert states["after teardown"] is False
        if mode == "close":
            assert states["after close"] is False
            assert next(r for r in mine if r.get("when") == "after close")["buffers_held_elsewhere"] == 0
        else:
            assert states["before teardown"] is True  # the atexit teardown, not the script, destroyed it
