"""`lmtrain train --config run.toml`, `--print-config` and run.json read back: one run file, flags over it."""

import json
import subprocess

import pytest
from trained_runs import tiny_run

from lmtrain.cli import build_parser, main
from lmtrain.train_run import draft_plan, request_from_args


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def plan_of(*argv):
    return draft_plan(request_from_args(build_parser().parse_args(["train", *map(str, argv)])))


def configs(plan):
    return plan.model.to_dict(), plan.train.to_dict(), plan.data


def test_printed_config_trains_the_same_run_as_the_flags(run, tmp_path, capsys):
    data = run.parent / "data"
    flags = ["--data", data, "--out", tmp_path / "r", "--preset", "tiny", "--max-steps", "7", "--set", "lr=2e-3",
             "--set", "model.dropout=0.1", "--set", "seq_len=16"]  # fmt: skip
    capsys.readouterr()
    assert main(["train", *map(str, flags), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "lr = 0.002" in printed and "dropout = 0.1" in printed and "# beta2 = 0.95" in printed
    assert not (tmp_path / "r").exists()  # printing trains nothing and writes nothing
    (tmp_path / "run.toml").write_text(printed)
    from_file = plan_of("--config", tmp_path / "run.toml")
    assert configs(from_file) == configs(plan_of(*flags))
    assert from_file.request.out == str((tmp_path / "r").resolve())


def test_flags_override_the_run_file_and_paths_are_relative_to_it(run, tmp_path):
    (tmp_path / "data").symlink_to(run.parent / "data")
    (tmp_path / "run.toml").write_text(
        'data = "data"\nout = "runs/a"\nrecipe = "tiny"\nmax_steps = 9\n\n[train]\nlr = 1e-3\nseed = 3\n'
        "\n[data_config]\nseq_len = 16\n"
    )
    plan = plan_of("--config", tmp_path / "run.toml", "--max-steps", "5", "--set", "lr=4e-3", "--out", tmp_path / "b")
    assert (plan.train.max_steps, plan.train.lr, plan.train.seed, plan.seq_len) == (5, 4e-3, 3, 16)
    assert plan.request.data == str(tmp_path / "data") and plan.request.out == str(tmp_path / "b")


def test_run_json_reads_back_as_the_config_of_a_new_run(run, tmp_path):
    saved = json.loads((run / "run.json").read_text())
    plan = plan_of("--config", run / "run.json", "--out", tmp_path / "again")
    assert plan.model.to_dict() == saved["model_config"]
    assert plan.train.to_dict() == saved["train_config"]
    assert plan.recipe == saved["recipe"] and plan.request.data == saved["data"]
    longer = plan_of("--config", run / "run.json", "--out", tmp_path / "again", "--max-steps", "8")
    assert (longer.train.max_steps, longer.train.t_max) == (8, 8)  # the decay follows the run's new end


@pytest.mark.parametrize(("text", "named"), [
    ('data = "d"\nrecipee = "tiny"\n', "unknown key 'recipee'; did you mean recipe"),
    ('data = "d"\nmax_steps = "ten"\n', "max_steps = 'ten': expected an integer"),
    ('data = "d"\ntime_budget_s = -5\n', "time_budget_s = -5: expected a finite number of seconds > 0"),
    ('data = "d"\n[train\n', "not valid TOML"),
    ('data = "d"\ntrain = 3\n', "train = 3: expected a table ([train])"),
    ('data = "d"\n[train]\nlearning_rate = 1e-3\n', "[train] learning_rate: no field 'learning_rate' in the train "
     "config; did you mean lr"),
])  # fmt: skip
def test_a_bad_run_file_is_one_line_and_writes_nothing(text, named, tmp_path, capsys):
    (tmp_path / "run.toml").write_text(text)
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmtrain train: error: --config ") and named in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_run_ends_with_a_block_people_read_or_its_facts_as_json(run, tmp_path, capsys):
    data = run.parent / "data"
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "r"), "--preset", "tiny", "--max-steps", "2",
            "--set", "eval_every=2", "--set", "log_every=1", "--set", "cpu_threads=1", "--no-progress"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    facts = json.loads((tmp_path / "r" / "summary.json").read_text())
    block = lines[lines.index("lmtrain: run finished") :]
    text = "\n".join(block)
    assert not any(line.startswith("{") for line in lines), "a JSON line without --json"
    assert facts["stopped"] is None and "planned end (max_steps 2), at step 2" in text
    assert "nats/token" in text and "bits/byte" in text and f"{int(facts['eval']['tokens']):,} tokens" in text
    assert f"-> {tmp_path / 'r' / 'checkpoints'}" in text and str(tmp_path / "r" / "loss.png") in text
    assert main([*argv[:4], str(tmp_path / "s"), *argv[5:], "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    facts = json.loads(lines[-1])
    assert "lmtrain: run finished" not in lines and facts["summary"]["step"] == 2
    assert facts["summary"]["reason"] == "planned end (max_steps 2)"


def test_the_printed_run_carries_the_plans_warnings(run, tmp_path, capsys):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}')
    assert main(["train", "--data", str(run.parent / "data"), "--out", str(tmp_path / "r"), "--preset", "tiny",
                 "--max-steps", "4", "--deepspeed", str(tmp_path / "ds.json"), "--print-config"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "# plan: warning: the learning rate stays at 0.0003 throughout" in printed, printed[:2000]


def test_tensorboard_and_wandb_are_flags(run, tmp_path):
    plan = plan_of("--data", run.parent / "data", "--out", tmp_path / "r", "--tensorboard", "--wandb", "my-project")
    assert plan.train.tensorboard is True and plan.train.wandb_project == "my-project"
    assert plan_of("--data", run.parent / "data", "--out", tmp_path / "r").train.tensorboard is False


def test_the_loss_plot_is_redrawn_at_every_evaluation(run, tmp_path, monkeypatch):
    import lmtrain.scaffold as scaffold
    import lmtrain.train_run as train_run

    drawn = []
    plot = scaffold.plot

    def recording_plot(run_dir):
        plot(run_dir)
        drawn.append((run_dir / "loss.png").is_file())

    monkeypatch.setattr(scaffold, "plot", recording_plot)
    train_run.train(run.parent / "data", tmp_path / "r", recipe="tiny", max_steps=6, quiet=True,
                    overrides={"eval_every": 2, "log_every": 1, "cpu_threads": 1})  # fmt: skip
    assert drawn == [True, True, True, True]  # after the evaluations at steps 2, 4 and 6, and once at the end


def test_gpumon_without_a_driver_is_one_plain_line(run, tmp_path, capsys):
    pytest.importorskip("gpumon")
    capsys.readouterr()
    assert main(["train", "--data", str(run.parent / "data"), "--out", str(tmp_path / "r"), "--preset", "tiny",
                 "--max-steps", "1", "--gpumon", "--set", "cpu_threads=1", "--no-progress"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    notice = [line for line in err.splitlines() if "NVML" in line]
    assert notice and all(line.startswith("lmtrain: warning: gpumon: NVML") for line in notice), err
    assert "UserWarning" not in err
    assert list((tmp_path / "r").glob("gpumon.*.csv"))


def test_a_yaml_run_file_reads_as_the_toml_one(run, tmp_path, monkeypatch, capsys):
    import sys

    pytest.importorskip("yaml")
    (tmp_path / "data").symlink_to(run.parent / "data")
    (tmp_path / "run.toml").write_text('data = "data"\nrecipe = "tiny"\nmax_steps = 9\n[train]\nlr = 1e-3\n')
    (tmp_path / "run.yaml").write_text("data: data\nrecipe: tiny\nmax_steps: 9\ntrain:\n  lr: 1.0e-3\n")
    toml, yaml = (plan_of("--config", tmp_path / name, "--out", tmp_path / "r") for name in ("run.toml", "run.yaml"))
    assert configs(toml) == configs(yaml) and yaml.train.lr == 1e-3
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a YAML run file needs PyYAML, which is not installed: pip install" in err[0], err


def test_the_printed_commands_reach_lmtrain_from_the_users_shell(tmp_path, monkeypatch):
    import sys

    from lmtrain.shell import lmtrain_command

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "lmtrain"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(script), "demo"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert lmtrain_command() == str(script.resolve())  # not on PATH: the full path, which works as printed
    monkeypatch.setenv("PATH", str(bin_dir))
    assert lmtrain_command() == "lmtrain"


def test_the_printed_export_line_says_what_it_needs_where_transformers_is_missing(tmp_path, monkeypatch):
    import importlib.util
    import sys

    from lmtrain.finetune_run import _next_commands
    from lmtrain.train_run import next_commands

    meta = {"val_path": str(tmp_path / "data" / "val.bin")}
    if importlib.util.find_spec("transformers") is not None:  # the hf extra is here (Python 3.11+)
        assert next_commands(tmp_path, meta)[-1].endswith(f"export --run {tmp_path} --out DIR")
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "transformers" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    needs = "# export to Hugging Face formats needs transformers: its hf extra needs Python 3.11 or newer"
    for commands in (next_commands(tmp_path, meta), _next_commands(tmp_path)):
        assert commands[-1].startswith(needs) and not any(" export " in c for c in commands[:-1])
        for line in commands:  # each line of the list is shell a user can paste: the note is a comment
            assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0, line


def test_the_printed_config_shows_what_the_run_will_use_with_or_without_data(run, tmp_path, capsys, monkeypatch):
    import re

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the thread count is then timed at launch
    capsys.readouterr()
    assert main(["train", "--time-budget", "60", "--print-config"]) == 0
    bare = capsys.readouterr().out
    assert '# data = "DATA_DIR"' in bare and "vocab_size = 2048  (the tokenizer's: give --data)" in bare
    assert main(["train", "--data", str(run.parent / "data"), "--time-budget", "60", "--print-config"]) == 0
    given = capsys.readouterr().out
    assert "vocab_size = 400\n" in given
    for printed in (bare, given):
        assert '# schedule = "wsd"  (sized to the time budget at launch)' in printed
        assert re.search(r"# early_stopping_patience = [1-9]\d*  \(sized to the time budget at launch\)", printed)
        assert re.search(r"# eval_every_s = [0-9.]+  \(sized to the time budget at launch\)", printed)
        assert 'cpu_threads = "none"  (one thread or all cores: timed at launch' in printed
