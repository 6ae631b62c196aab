"""Collectives and teardown on 2 gloo ranks: sums and JSON broadcasts through trainloop's buffers, and the process
group destroyed by Trainer.close() or, for a script that never closes its Trainer, before the interpreter exits; a
one-rank group's port taken between its choice and its bind."""

import json
import os
import socket

import pytest
import torch.distributed as dist
from launch import run

from trainloop import distributed


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


@pytest.mark.parametrize("taken", [1, distributed.PORT_ATTEMPTS])
def test_a_port_taken_before_the_bind_is_replaced_by_another(monkeypatch, taken):
    """The first ports chosen are taken by the time the group's store binds them (here by this test, listening on
    them): the next free one is used; when every attempt's port is taken, torch's EADDRINUSE error is raised."""
    listeners = []
    for _ in range(taken):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        listeners.append(s)
    ports = iter([s.getsockname()[1] for s in listeners])
    real, chosen = distributed._free_port, []

    def taken_first():
        chosen.append(next(ports, None) or real())
        return chosen[-1]

    monkeypatch.setattr(distributed, "_free_port", taken_first)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "")
    monkeypatch.delenv("MASTER_PORT")  # restored as it was (unset) after the test
    try:
        if taken < distributed.PORT_ATTEMPTS:
            distributed.init_on_a_free_port(lambda: dist.init_process_group("gloo", rank=0, world_size=1))
            assert dist.is_initialized() and len(chosen) == taken + 1
            assert os.environ["MASTER_PORT"] == str(chosen[-1])
        else:
            with pytest.raises(dist.DistNetworkError, match="EADDRINUSE"):
                distributed.init_on_a_free_port(lambda: dist.init_process_group("gloo", rank=0, world_size=1))
            assert len(chosen) == distributed.PORT_ATTEMPTS and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for s in listeners:
            s.close()


def test_the_teardown_waits_for_a_gloo_worker_still_running_python(tmp_path):
    """A rank whose gloo worker runs Python (here a collective's callback, computing for a second) when the script
    ends must exit cleanly after the worker is done: the atexit teardown waits until the workers are idle."""
    run("late_release.py", {"run_dir": str(tmp_path), "busy_s": 1.0}, nproc=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"released_{rank}.json").read_text()) == {"thread": distributed.GLOO_WORKER}
