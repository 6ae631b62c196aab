"""ZeRO offload settings that cannot work are refused in one line naming the field, the value and the fix, when the
DeepSpeed config is adopted (before ``deepspeed.initialize`` runs on any rank)."""

import json
import os
import sys
from pathlib import Path

import pytest

from trainloop import ConfigError, TrainConfig, adopt_ds_config, build_ds_config
from trainloop.offload import aio_unavailable_reason, offload_problems


def _zero(stage, **blocks):
    return {"zero_optimization": {"stage": stage, **blocks}}


def _nvme(path):
    return {"device": "nvme", "nvme_path": str(path)}


def _bad_inputs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    missing = tmp_path / "no-such-dir"
    return [
        ("offload_param stage 2", _zero(2, offload_param={"device": "cpu"}),
         ["zero_optimization.offload_param.device='cpu' with stage 2", "set zero_optimization.stage to 3"]),
        ("offload_param stage 1 nvme", _zero(1, offload_param=_nvme(tmp_path)),
         ["zero_optimization.offload_param.device='nvme' with stage 1", "remove offload_param"]),
        ("optimizer nvme stage 2", _zero(2, offload_optimizer=_nvme(tmp_path)),
         ["zero_optimization.offload_optimizer.device='nvme' with stage 2", "use device 'cpu', or stage 3"]),
        ("nvme_path missing", _zero(3, offload_param={"device": "nvme"}),
         ["zero_optimization.offload_param.nvme_path is missing", "set it to one on a local NVMe drive"]),
        ("nvme_path does not exist", _zero(3, offload_param=_nvme(missing)),
         [f"zero_optimization.offload_param.nvme_path='{missing}' does not exist", f"mkdir -p {missing}"]),
        ("nvme_path a file", _zero(3, offload_optimizer=_nvme(a_file)),
         [f"zero_optimization.offload_optimizer.nvme_path='{a_file}' is not a directory"]),
        # /proc: nobody can create a file there, root included (root writes through mode bits, see the next test).
        ("nvme_path not writable", _zero(3, offload_param=_nvme("/proc")),
         ["zero_optimization.offload_param.nvme_path='/proc' is not writable", "pick another directory"]),
        ("offload block not an object", _zero(3, offload_param="nvme"),
         ["zero_optimization.offload_param='nvme' must be a JSON object"]),
    ]  # fmt: skip


NAMES = [
    "offload_param stage 2",
    "offload_param stage 1 nvme",
    "optimizer nvme stage 2",
    "nvme_path missing",
    "nvme_path does not exist",
    "nvme_path a file",
    "nvme_path not writable",
    "offload block not an object",
]


@pytest.mark.parametrize("name", NAMES)
def test_bad_offload_settings_are_one_line_naming_field_value_and_fix(tmp_path, name):
    (ds, words), *_ = [(ds, words) for n, ds, words in _bad_inputs(tmp_path) if n == name]
    if name == "nvme_path not writable" and not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    for adopt in (True, False):
        with pytest.raises(ConfigError) as err:
            if adopt:  # what lmtrain does on every rank before the engine exists
                adopt_ds_config(ds, TrainConfig(engine="deepspeed"), 2, on_cpu=True)
            else:
                build_ds_config(ds, TrainConfig(engine="deepspeed"), 2, on_cpu=True)
        message = str(err.value)
        assert "\n" not in message and message.startswith("DeepSpeed config: "), message
        for word in words:
            assert word in message, (word, message)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root creates files in a mode-0500 dir")
def test_an_nvme_path_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    (problem,) = offload_problems({"offload_param": _nvme(locked)}, stage=3)
    assert f"nvme_path='{locked}' is not writable" in problem and "Permission denied" in problem


def test_nvme_where_the_async_io_op_cannot_build_is_refused(tmp_path, monkeypatch):
    builder = pytest.importorskip("deepspeed.ops.op_builder").AsyncIOBuilder
    # What a machine without libaio reports (this one may have it): DeepSpeed's own check says False.
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    aio_unavailable_reason.cache_clear()
    try:
        ds = _zero(3, offload_param=_nvme(tmp_path), offload_optimizer=_nvme(tmp_path))
        with pytest.raises(ConfigError) as err:
            adopt_ds_config(ds, TrainConfig(engine="deepspeed"), 2, on_cpu=True)
    finally:
        aio_unavailable_reason.cache_clear()
    message = str(err.value)
    assert "zero_optimization.offload_param and zero_optimization.offload_optimizer.device='nvme' needs DeepSpeed's " \
           "async I/O op, which cannot build here" in message  # fmt: skip
    assert "apt-get install libaio-dev" in message and "\n" not in message


def test_good_offload_settings_pass_and_the_line_says_where_the_parameters_live(tmp_path):
    ds = _zero(3, offload_param={"device": "cpu", "pin_memory": True}, offload_optimizer={"device": "cpu"})
    adoption = adopt_ds_config(ds, TrainConfig(engine="deepspeed"), 2, on_cpu=True)
    assert "ZeRO-3 keeps the parameter partitions on cpu" in adoption.line
    assert "(fused, on the host for offload_optimizer cpu)" in adoption.line
    assert offload_problems({"offload_param": {"device": "none"}}, stage=2) == []  # DeepSpeed's "off"
    if aio_unavailable_reason() is None:
        nvme = adopt_ds_config(_zero(3, offload_param=_nvme(tmp_path)), TrainConfig(engine="deepspeed"), 2,
                               on_cpu=True)  # fmt: skip
        assert f"ZeRO-3 keeps the parameter partitions on nvme ({tmp_path})" in nvme.line


KIT_2_7B = Path(__file__).resolve().parents[3] / "tools" / "cluster-3090" / "ds_config_2.7b.json"


@pytest.mark.skipif(not KIT_2_7B.is_file(), reason="tools/cluster-3090 is not beside this package")
def test_the_kits_2_7b_config_is_zero3_with_accumulation_16_and_names_its_missing_nvme_directory(tmp_path):
    recipe = TrainConfig(lr=1e-3, micro_batch=8, grad_accum=2, precision="bf16", engine="deepspeed")
    kit = json.loads(KIT_2_7B.read_text())
    nvme_path = kit["zero_optimization"]["offload_param"]["nvme_path"]
    if not Path(nvme_path).exists():  # as shipped, on a machine without that directory: one line saying so
        with pytest.raises(ConfigError) as err:
            adopt_ds_config(KIT_2_7B, recipe, 32, on_cpu=False)
        assert f"offload_param.nvme_path='{nvme_path}' does not exist: create it (mkdir -p {nvme_path})" in str(
            err.value
        )
    kit["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    if aio_unavailable_reason() is not None:
        kit["zero_optimization"]["offload_param"]["device"] = "cpu"
    path = tmp_path / "ds_config_2.7b.json"
    path.write_text(json.dumps(kit))
    adoption = adopt_ds_config(path, recipe, 32, on_cpu=False)
    cfg = adoption.config
    assert (cfg.micro_batch, cfg.grad_accum, cfg.precision, cfg.lr, cfg.clip) == (2, 16, "bf16", 3e-4, 1.0)
    zero = adoption.ds_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["max_in_cpu"] == 0  # the partitions stay on the drive
    assert adoption.ds_config["train_batch_size"] == 1024
