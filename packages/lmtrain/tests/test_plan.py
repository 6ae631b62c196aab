"""The run plan as a value: plan_run writes nothing, asks for the step times it needs, keeps the user's word, says
what it decided; train() runs the plan and resolves a DeepSpeed config once."""

import json
import os

import pytest

from lmtrain.errors import LmtrainError
from lmtrain.plan import DataInfo, TrainRequest, World, plan_run, train_record
from lmtrain.run_files import read_meta
from lmtrain.run_record import RunRecord


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from lmtrain.examples import tiny_data

    return tiny_data(tmp_path_factory.mktemp("plan"))


def _info(data, saved=None):
    meta = read_meta(data)
    return DataInfo(meta, train_tokens=meta["train"]["tokens"], saved_run=saved)


def test_planning_writes_nothing_and_is_repeatable(data, tmp_path):
    before = sorted(os.listdir(data))
    request = TrainRequest(data=str(data), out=str(tmp_path / "run"), recipe="tiny", time_budget_s=60,
                           overrides={"lr": "2e-3", "model.dropout": 0.05})  # fmt: skip
    world = World(cpu_count=2, step_s={1: 0.05, 2: 0.08}, elapsed_s=10.0)
    first, second = plan_run(request, _info(data), world), plan_run(request, _info(data), world)
    assert train_record(first, _info(data)) == train_record(second, _info(data)) and first.lines() == second.lines()
    assert sorted(os.listdir(data)) == before and not (tmp_path / "run").exists()
    assert first.train.lr == 2e-3 and first.model.dropout == 0.05  # the string converted, the float taken as is
    assert {"lr", "dropout"} <= first.fixed


def test_a_budget_asks_for_step_times_then_charges_the_setup(data, tmp_path):
    request = TrainRequest(data=str(data), out=str(tmp_path / "run"), recipe="tiny", time_budget_s=60)
    draft = plan_run(request, _info(data), World(cpu_count=2))
    assert draft.time_threads == (1, 2) and draft.train.time_budget_s == 60.0  # nothing sized yet
    plan = plan_run(request, _info(data), World(cpu_count=2, step_s={1: 0.08, 2: 0.05}, elapsed_s=12.5))
    assert plan.time_threads == () and plan.cpu_threads == 2 and plan.step_s == 0.05
    assert plan.train.time_budget_s == 60.0 - 12.5 and plan.train.schedule == "wsd" and plan.budgeted
    assert plan.first_guess == int(2 * 47.5 / 0.05)
    assert any(line.startswith("plan: the budget buys about") for line in plan.lines())
    # With the threads fixed by the environment, only the threads in use are timed.
    fixed = plan_run(request, _info(data), World(cpu_count=2, threads_fixed=True, threads_now=2))
    assert fixed.time_threads == (2,)
    # Steps given by hand: the budget only caps the run, nothing is timed.
    capped = plan_run(TrainRequest(data=str(data), out="r", recipe="tiny", time_budget_s=60, max_steps=50),
                      _info(data), World(threads_fixed=True))  # fmt: skip
    assert not capped.budgeted and capped.train.max_steps == 50 and capped.time_threads == ()


def test_a_resumed_run_keeps_its_configs_and_says_what_it_ignored(data, tmp_path):
    fresh = plan_run(TrainRequest(data=str(data), out=str(tmp_path), recipe="tiny", max_steps=8),
                     _info(data), World(threads_fixed=True))  # fmt: skip
    saved = RunRecord.from_json(json.loads(json.dumps(train_record(fresh, _info(data)).to_json())), "run.json")
    request = TrainRequest(data=str(data), out=str(tmp_path), recipe="cpu-small", resume=True)
    resumed = plan_run(request, _info(data, saved), World(threads_fixed=True, world_size=2))
    assert resumed.recipe == "tiny" and resumed.model.to_dict() == fresh.model.to_dict()
    assert resumed.train.grad_accum * resumed.train.micro_batch * 2 == fresh.train.micro_batch * fresh.train.grad_accum
    assert any("--preset cpu-small ignored" in line for line in resumed.lines())
    assert any(line.startswith("resuming a run of 1 rank(s) on 2") for line in resumed.lines())
    assert train_record(resumed, _info(data, saved)).world_size == 2


@pytest.mark.parametrize(
    ("request_args", "message"),
    [
        ({"recipe": "nope"}, "--preset 'nope' is unknown"),
        ({"overrides": {"lerning_rate": 1}}, "did you mean"),
        ({"overrides": {"sampler": "epoch"}, "data": "mix.json"}, "a blend draws its windows at random"),
        ({"overrides": {"vocab_size": 10}}, "token ids would index past the embedding table"),
    ],
)
def test_bad_requests_are_one_line(data, request_args, message):
    args = {"data": str(data), "out": "r", "recipe": "tiny", **request_args}
    if args["data"] == "mix.json":
        spec = {"sources": [{"path": "train.bin", "weight": 1.0}]}
        (data / "mix.json").write_text(json.dumps(spec))
        args["data"] = str(data / "mix.json")
    with pytest.raises(LmtrainError, match=message) as info:
        plan_run(TrainRequest(**args), _info(data), World(threads_fixed=True))
    assert "\n" not in str(info.value)


def test_train_resolves_a_deepspeed_config_once_and_hands_deepspeed_the_dict(data, tmp_path, monkeypatch):
    import trainloop.ds_config as ds_config
    import trainloop.engine_deepspeed as engine_deepspeed

    deepspeed = pytest.importorskip("deepspeed")
    calls, given = [], []
    real_build, real_initialize = ds_config.build_ds_config, deepspeed.initialize

    def counting_build(*args, **kwargs):
        calls.append(args[0])
        return real_build(*args, **kwargs)

    def recording_initialize(*args, config, **kwargs):
        given.append(config)
        return real_initialize(*args, config=config, **kwargs)

    monkeypatch.setattr(ds_config, "build_ds_config", counting_build)
    monkeypatch.setattr(engine_deepspeed, "build_ds_config", counting_build)
    monkeypatch.setattr(deepspeed, "initialize", recording_initialize)
    from lmtrain import train

    summary = train(data, tmp_path / "run", recipe="tiny", max_steps=2, quiet=True,
                    deepspeed={"zero_optimization": {"stage": 2}}, overrides={"cpu_threads": 1})  # fmt: skip
    assert summary.step == 2
    assert len(calls) == 1  # the adoption's: the plan and the engine reused it
    assert isinstance(given[0], dict) and given[0] == summary.plan.ds_config.config


def test_a_budgeted_cpu_run_takes_bf16_only_where_it_measured_faster(data, tmp_path):
    request = TrainRequest(data=str(data), out=str(tmp_path), recipe="tiny", time_budget_s=60)
    timed = {"cpu_count": 2, "step_s": {1: 0.10, 2: 0.12}, "native_bf16": True}
    draft = plan_run(request, _info(data), World(**timed))
    assert draft.time_bf16 and draft.measuring and draft.train.precision == "fp32"
    faster = plan_run(request, _info(data), World(**timed, bf16_step_s=0.06))
    assert faster.train.precision == "bf16" and faster.step_s == 0.06 and not faster.measuring
    assert any(line.startswith("bf16 autocast: ") and "1.67x faster" in line for line in faster.lines())
    slower = plan_run(request, _info(data), World(**timed, bf16_step_s=0.13))
    assert slower.train.precision == "fp32" and any("measured 0.77x" in line for line in slower.lines())
    # Not native, or the precision set by the user: nothing is timed, nothing is changed.
    assert not plan_run(request, _info(data), World(**{**timed, "native_bf16": False})).time_bf16
    mine = TrainRequest(data=str(data), out=str(tmp_path), recipe="tiny", time_budget_s=60,
                        overrides={"precision": "fp32"})  # fmt: skip
    assert not plan_run(mine, _info(data), World(**timed)).time_bf16


def test_compile_and_the_matmul_probe_reach_lmcore(data, tmp_path, monkeypatch):
    import lmcore

    compiled, probed = [], []
    monkeypatch.setattr(lmcore, "compile_model", lambda model, **kw: compiled.append(type(model).__name__) or model)
    real_route = lmcore.route_cpu_matmuls

    def route(cfg, tokens, *, enabled=True):
        probed.append(enabled)
        return real_route(cfg, tokens, enabled=False)

    monkeypatch.setattr(lmcore, "route_cpu_matmuls", route)
    from lmtrain import train

    train(data, tmp_path / "run", recipe="tiny", max_steps=1, compile=True, quiet=True,
          overrides={"cpu_threads": 1, "cpu_matmul_probe": False})  # fmt: skip
    assert compiled == ["GPT"] and probed == [False]


def test_token_counts_must_match_and_hold_a_window(data, tmp_path):
    request = TrainRequest(data=str(data), out=str(tmp_path), recipe="tiny")
    meta = read_meta(data)
    with pytest.raises(LmtrainError, match="meta.json says the training split has"):
        plan_run(request, DataInfo(meta, train_tokens=meta["train"]["tokens"] - 1), World(threads_fixed=True))
    short = {**meta, "val": {**meta["val"], "tokens": 20}}
    with pytest.raises(
        LmtrainError, match=r"the validation split has 20 tokens, fewer than one window of seq_len \+ 1 = 33"
    ):
        plan_run(request, DataInfo(short, train_tokens=meta["train"]["tokens"]), World(threads_fixed=True))


def test_every_window_that_fits_is_evaluated():
    import numpy as np

    from lmtrain.train_run import val_batches

    class Tokens:  # exactly two windows of 8 + 1 tokens, and one token to spare
        n_tokens = 2 * 8 + 1

        def gather(self, starts, seq_len):
            return np.asarray(starts), None

    got = [s.tolist() for s, _ in val_batches(Tokens(), 8, 4)()]
    assert got == [[0, 8]], got


def test_the_world_reports_what_the_planner_rules_need():
    import torch

    import lmcore
    from lmtrain.scaffold import current_world

    world = current_world()
    assert world.native_bf16 == (not torch.cuda.is_available() and lmcore.cpu_has_native_bf16())
    assert world.threads_now == torch.get_num_threads() and world.cpu_count >= 1


def test_the_plan_warns_of_a_missing_end_a_run_past_a_day_and_a_flat_schedule(data, tmp_path):
    def warnings(**request):
        plan = plan_run(TrainRequest(data=str(data), out=str(tmp_path), recipe="tiny", **request), _info(data),
                        World(cpu_count=2, step_s={1: 1.0, 2: 2.0}))  # fmt: skip
        return [line for line in plan.lines() if line.startswith("warning: ")]

    unbounded = warnings(overrides={"max_steps": 100_000, "min_lr": 1e-5})
    assert unbounded == ["warning: 100,000 steps at the measured 1.000 s/step take about 1.2 days on this CPU; "
                         "--time-budget SECONDS bounds the run"]  # fmt: skip
    assert any("no --time-budget or --max-steps: training the recipe's" in w for w in warnings())
    assert warnings(max_steps=50, overrides={"min_lr": 1e-5}) == []
    # The kit's DeepSpeed JSON sets lr 3e-4: the tiny recipe's min_lr is 3e-4 too, so nothing decays.
    ds = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    flat = warnings(max_steps=50, deepspeed=ds)
    assert len(flat) == 1 and "the learning rate stays at 0.0003 throughout" in flat[0], flat
