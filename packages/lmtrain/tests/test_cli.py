import json
import os

import pytest

from lmtrain.cli import build_parser, main
from lmtrain.doctor import Check, check_nccl_env, read_hostfile


def test_train_flags_parse():
    args = build_parser().parse_args(
        ["train", "--data", "d", "--out", "r", "--preset", "tiny", "--max-steps", "5", "--time-budget", "30",
         "--resume", "--gpumon", "--deepspeed", "ds.json", "--set", "log_every=1", "--set", "save_every=10"]
    )  # fmt: skip
    assert args.overrides == ["log_every=1", "save_every=10"]
    assert (args.max_steps, args.time_budget, args.resume, args.gpumon) == (5, 30.0, True, True)


@pytest.mark.parametrize("command", ["prepare", "train", "eval", "generate", "export", "doctor", "demo"])
def test_every_command_takes_no_progress(command, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert "--no-progress" in capsys.readouterr().out


@pytest.mark.parametrize("fault", [None, "environ_not_restored"])
@pytest.mark.parametrize("before", [None, "0"])
def test_no_progress_sets_tqdm_disable_for_the_command_only(tmp_path, monkeypatch, before, fault):
    # The flag becomes TQDM_DISABLE, which tqdm reads in every package (and trainloop's loop), while the command
    # runs; after main() the environment is as it was, or a later caller in the process (a test of trainloop's
    # progress bar) would find its bars disabled.
    monkeypatch.setenv("TQDM_DISABLE", "placeholder")  # registers the variable's original state for teardown
    if before is None:
        monkeypatch.delenv("TQDM_DISABLE")
    else:
        monkeypatch.setenv("TQDM_DISABLE", before)
    if fault == "environ_not_restored":
        monkeypatch.setattr("lmtrain.cli.restore_environ", lambda found: None)
    during = []
    monkeypatch.setattr("lmtrain.evaluate.run_eval", lambda args: during.append(os.environ.get("TQDM_DISABLE")))
    assert main(["eval", "--run", str(tmp_path / "none"), "--text", "t", "--no-progress"]) == 0
    assert during == ["1"]
    if fault is None:
        assert os.environ.get("TQDM_DISABLE") == before
    else:
        assert os.environ.get("TQDM_DISABLE") == "1"  # the leak the equality above catches


def test_preset_and_model_config_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--data", "d", "--out", "r", "--preset", "tiny", "--model-config", "c"])


def test_missing_data_dir_is_a_clean_error(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 2
    assert "meta.json" in capsys.readouterr().err


def test_hostfile_parsing(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# comment\nnode1 slots=4\n\nnode2 slots=2  # two cards\nnode3\n")
    assert read_hostfile(path) == [("node1", 4), ("node2", 2), ("node3", 1)]


def test_async_error_handling_off_fails(monkeypatch):
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")
    checks = check_nccl_env(multi_node=True)
    assert any(c.status == "FAIL" and c.name == "async errors" for c in checks)


def test_obsolete_nrings_warns(monkeypatch):
    monkeypatch.setenv("NCCL_MIN_NRINGS", "4")
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    statuses = {c.name: c.status for c in check_nccl_env(multi_node=False)}
    assert statuses["NCCL_MIN_NRINGS"] == "WARN" and statuses["async errors"] == "OK"


def test_check_line_shows_fix_only_when_not_ok():
    assert "->" not in Check("OK", "x", "fine", "do this").line()
    assert "-> do this" in Check("WARN", "x", "hmm", "do this").line()


def test_cluster_config_matches_the_1_3b_preset():
    from pathlib import Path

    from lmcore import ModelConfig, n_params

    kit = Path(__file__).resolve().parents[3] / "tools" / "cluster-3090"
    if not kit.is_dir():
        pytest.skip(f"{kit} is not part of an installed package")
    config = ModelConfig.from_dict(json.loads((kit / "config.json").read_text()))
    assert n_params(config) == n_params(ModelConfig.from_preset("1.3b"))
    ds = json.loads((kit / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 1.0
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 16
