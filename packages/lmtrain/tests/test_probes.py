"""A run's CPU choices (threads, the fp32 GEMM library) do not depend on the machine's load: a resumed run and a
run started --init-from it compute with what the run recorded, a fresh run with the machine's earlier answer, and
the user's settings come first (lmtrain.probes)."""

import json

import pytest
import torch

import lmcore
import lmtrain.scaffold as scaffold
from lmcore.cpu_math import MatmulProbe, cpu_matmul_library, set_cpu_matmul_library
from lmtrain import train
from lmtrain.run_record import read_run_record

STEADY = {"eval_every": 0, "log_every": 1, "save_every": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from lmtrain.examples import tiny_data

    return tiny_data(tmp_path_factory.mktemp("probes"))


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A probe whose answers the test sets, counting its calls; a cache of the test's own; OMP_NUM_THREADS unset,
    so that the thread probe runs; the threads and GEMM library put back afterwards."""
    answers = {"fastest": 1, "onednn": True, "calls": 0}

    def pick(model, micro_batch, seq_len, vocab_size, counts=None, *, precision="fp32"):
        answers["calls"] += 1
        return {n: (0.1 if n == answers["fastest"] else 0.2) for n in counts or (1, 2)}

    def route(config, tokens, *, enabled=True, max_seconds=1.0):
        answers["calls"] += 1
        routed = enabled and answers["onednn"]
        set_cpu_matmul_library("onednn" if routed else "mkl")
        return MatmulProbe(routed, "the test's answer")

    monkeypatch.setattr(scaffold, "pick_cpu_threads", pick)
    monkeypatch.setattr(lmcore, "route_cpu_matmuls", route)
    monkeypatch.setenv("LMTRAIN_PROBE_CACHE", str(tmp_path / "probes.json"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    threads = torch.get_num_threads()
    yield answers
    torch.set_num_threads(threads)
    set_cpu_matmul_library("mkl")


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_resumed_run_keeps_its_recorded_choices_whatever_the_probe_says_now(data, tmp_path, probe):
    run = tmp_path / "run"
    train(data, run, recipe="tiny", max_steps=2, quiet=True, overrides=STEADY)
    first = read_run_record(run)
    assert (first.cpu_threads, first.cpu_matmul) == (1, "onednn")
    (tmp_path / "probes.json").unlink()  # only the run's own record can keep the choice now
    probe.update(fastest=2, onednn=False, calls=0)  # the load changed: the probes would answer otherwise
    train(data, run, recipe="tiny", max_steps=4, resume=True, quiet=True, overrides=STEADY)
    resumed = read_run_record(run)
    assert (resumed.cpu_threads, resumed.cpu_matmul) == (1, "onednn")
    assert torch.get_num_threads() == 1 and cpu_matmul_library() == "onednn" and probe["calls"] == 0
    # A run started from it computes with its choices too.
    train(data, tmp_path / "next", recipe="tiny", max_steps=1, init_from=f"{run}:latest", quiet=True,
          overrides=STEADY)  # fmt: skip
    assert read_run_record(tmp_path / "next").cpu_threads == 1 and probe["calls"] == 0


def test_identical_fresh_runs_compute_alike_whatever_the_probe_says(data, tmp_path, probe):
    train(data, tmp_path / "a", recipe="tiny", max_steps=3, quiet=True, overrides=STEADY)
    assert probe["calls"] == 2  # threads and the GEMM library, once each
    probe.update(fastest=2, onednn=False, calls=0)
    train(data, tmp_path / "b", recipe="tiny", max_steps=3, quiet=True, overrides=STEADY)
    a, b = read_run_record(tmp_path / "a"), read_run_record(tmp_path / "b")
    assert (b.cpu_threads, b.cpu_matmul) == (a.cpu_threads, a.cpu_matmul) == (1, "onednn") and probe["calls"] == 0
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    assert any("as this machine's probe cache recorded" in note or "as recorded" in note for note in b.notes)


def test_the_users_settings_come_first_and_are_not_cached(data, tmp_path, probe):
    train(data, tmp_path / "a", recipe="tiny", max_steps=1, quiet=True, overrides=STEADY)  # caches 1 and oneDNN
    train(data, tmp_path / "b", recipe="tiny", max_steps=1, quiet=True,
          overrides={**STEADY, "cpu_threads": 2, "cpu_matmul_probe": False})  # fmt: skip
    b = read_run_record(tmp_path / "b")
    assert (b.cpu_threads, b.cpu_matmul) == (2, "mkl") and cpu_matmul_library() == "mkl"
    cached = json.loads((tmp_path / "probes.json").read_text())
    assert sorted(map(str, (v for answers in cached.values() for v in answers.values()))) == ["1", "onednn"]


def test_eval_and_generate_run_with_the_threads_the_run_trained_with(data, tmp_path, probe, monkeypatch):
    from lmtrain.run_files import load_trained_model

    train(data, tmp_path / "run", recipe="tiny", max_steps=1, quiet=True, overrides=STEADY)  # probed: 1 thread
    torch.set_num_threads(2)
    load_trained_model(tmp_path / "run")
    assert torch.get_num_threads() == 1
    # A run that recorded no CPU choice (trained on a GPU) gets the machine's probed answer for its shapes, once.
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    (tmp_path / "run" / "run.json").write_text(json.dumps({**record, "cpu_matmul": None}))
    timed = []
    monkeypatch.setattr(
        lmcore, "time_step", lambda fn, n, **kw: timed.append(n) or lmcore.StepTiming(n, 3.0 - n, 1.0, 2)
    )
    load_trained_model(tmp_path / "run")
    assert torch.get_num_threads() == 2 and sorted(timed) == [1, 2]
    torch.set_num_threads(1)
    load_trained_model(tmp_path / "run")
    assert torch.get_num_threads() == 2 and len(timed) == 2  # cached: not timed again


@pytest.mark.parametrize("recorded", ["onednn", "mkl"])
def test_eval_and_generate_compute_on_the_gemm_library_the_run_trained_with(data, tmp_path, probe, recorded):
    from lmtrain.run_files import load_trained_model

    probe["onednn"] = recorded == "onednn"
    train(data, tmp_path / "run", recipe="tiny", max_steps=1, quiet=True, overrides=STEADY)
    assert read_run_record(tmp_path / "run").cpu_matmul == recorded
    set_cpu_matmul_library("mkl" if recorded == "onednn" else "onednn")  # what another process would start with
    load_trained_model(tmp_path / "run")
    assert cpu_matmul_library() == recorded
