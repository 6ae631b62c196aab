"""`lmtrain train --init-from RUN[:CKPT]`: the weights of another run's checkpoint, exactly, with a fresh optimizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from trained_runs import tiny_run

import tokbin
from lmcore import GPT, ModelConfig
from lmtrain import train
from lmtrain.cli import main
from lmtrain.init_from import load_init_weights, read_init_source


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def test_weights_load_exactly(run):
    source = read_init_source(f"{run}:2", tokbin.file_sha256(run / "tokenizer.model"))
    saved = load_file(str(run / "checkpoints" / "step_00000002" / "model.safetensors"))
    model = GPT(ModelConfig.from_dict(dict(source.model_config)))
    load_init_weights(model, source)
    own = model.state_dict()
    assert saved and all(torch.equal(own[k], v) for k, v in saved.items())


def test_train_init_from_records_the_source_and_starts_fresh(run, tmp_path):
    out = tmp_path / "next"
    summary = train(run.parent / "data", out, init_from=f"{run}:latest", max_steps=2, quiet=True,
                    overrides={"cpu_threads": 1, "log_every": 1, "eval_every": 2})  # fmt: skip
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["init_from"]["checkpoint"] == "step_00000004"
    assert recorded["model_config"] == json.loads((run / "run.json").read_text())["model_config"]
    assert summary.step == 2  # a fresh schedule: steps count from 0, not from the source's 4
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1


def test_another_tokenizer_is_refused(run, tmp_path, capsys):
    other = tmp_path / "run"
    shutil.copytree(run, other)
    recorded = json.loads((other / "run.json").read_text())
    recorded["tokenizer_sha256"] = "0" * 64
    (other / "run.json").write_text(json.dumps(recorded))
    code = main(["train", "--data", str(run.parent / "data"), "--out", str(tmp_path / "new"), "--init-from",
                 f"{other}:latest", "--max-steps", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "tokenizer sha256 0000" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def test_a_run_without_checkpoints_is_refused(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "run.json", empty / "run.json")
    shutil.copy(run / "tokenizer.model", empty / "tokenizer.model")
    code = main(["train", "--data", str(run.parent / "data"), "--out", str(tmp_path / "new"), "--init-from",
                 str(empty), "--max-steps", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "no complete checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()
