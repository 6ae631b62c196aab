"""The narrow engine: the Protocol's members, a built engine handed to the Trainer, and the loop state that one
state_dict carries (checkpoints of before TrainState, with the same fields at the top level, still load)."""

import typing

import pytest
import torch
from tiny_model import SeqData, TinyLM

from trainloop import ConfigError, Engine, TrainConfig, Trainer, TrainState, make_engine


def test_the_engine_protocol_has_seven_members():
    members = {name for name in Engine.__dict__ if not name.startswith("_")} | set(typing.get_type_hints(Engine))
    assert members == {"name", "module", "backward", "clip_and_step", "forward_eval", "save", "load"}


def test_a_built_engine_trains_like_a_model(tmp_path):
    cfg = TrainConfig(max_steps=4, micro_batch=4, log_every=1, progress=False, tensorboard=False)
    torch.manual_seed(0)
    by_model = Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path / "a").fit()
    torch.manual_seed(0)
    engine = make_engine(TinyLM(), cfg)
    assert isinstance(engine, Engine) and engine.name == "torch"
    by_engine = Trainer(engine, cfg, SeqData(4), run_dir=tmp_path / "b").fit()
    assert by_engine["loss"] == by_model["loss"] and by_engine["step"] == 4
    with pytest.raises(ConfigError, match="pass it to make_engine"):
        Trainer(engine, cfg, SeqData(4), run_dir=tmp_path / "c", ds_config={"zero_optimization": {"stage": 2}})


def test_train_state_round_trips_and_reads_the_flat_layout():
    state = TrainState(step=12, tokens_seen=4096, total_skips=1, train_seconds=3.5, best=(10, 2.25), next_eval_s=6.0)
    assert TrainState.from_state_dict(state.state_dict()) == state
    flat = {"step": 12, "tokens_seen": 4096, "consecutive_skips": 0, "total_skips": 1, "train_seconds": 3.5,
            "best": [10, 2.25], "evals_since_best": 0, "next_eval_s": 6.0, "schedule": {"kind": "config"}}  # fmt: skip
    assert TrainState.from_state_dict(flat) == state
