"""engine="fsdp" settings that cannot work are refused before anything trains, each in one line naming the setting
and the fix (no process group is started by these cases)."""

from __future__ import annotations

import pytest
import torch
from tiny_model import BlocksLM, TinyLM
from torch import nn

from trainloop import CheckpointError, ConfigError, TrainConfig, Trainer
from trainloop.checkpoint import CheckpointStore
from trainloop.distributed import setup_distributed
from trainloop.engine_fsdp import FSDPEngine, shard_units


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_blocks_are_found_from_the_model_not_from_a_class_name():
    model = BlocksLM(n_blocks=3)
    assert shard_units(model) == list(model.blocks)

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def shard_units(self):
            return [self.b]

    hooked = Hooked()
    assert shard_units(hooked) == [hooked.b]
    assert [type(m).__name__ for m in shard_units(model, ["LayerNorm"])] == ["LayerNorm"] * 4


def test_a_model_without_blocks_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as exc:
        shard_units(TinyLM())
    text = _one_line(exc)
    assert "TinyLM has no blocks to shard" in text and "TrainConfig.fsdp_units" in text and "engine='torch'" in text
    with pytest.raises(ConfigError) as exc:
        shard_units(BlocksLM(), ["DecoderLayer"])
    assert "no module of class ['DecoderLayer']" in _one_line(exc) and "Block" in str(exc.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"engine": "fsdp", "precision": "fp16"}, "TrainConfig.precision='fp16' is invalid"),
        ({"engine": "torch", "fsdp_cpu_offload": True}, "applies to engine='fsdp' only"),
        ({"engine": "deepspeed", "fsdp_checkpoint": "full"}, "applies to engine='fsdp' only"),
        ({"engine": "torch", "fsdp_sync_every_micro": True}, "applies to engine='fsdp' only"),
        ({"engine": "fsdp", "fsdp_checkpoint": "zip"}, "allowed values are sharded, full"),
        ({"engine": "fsdp", "fsdp_units": []}, "non-empty list of module class names"),
    ],
)
def test_fsdp_settings_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**kwargs)
    assert words in _one_line(exc)


def test_cpu_offload_without_a_gpu_is_refused():
    cfg = TrainConfig(engine="fsdp", fsdp_cpu_offload=True)
    with pytest.raises(ConfigError) as exc:
        FSDPEngine(BlocksLM(), cfg, torch.device("cpu"), 1)
    assert "fsdp_cpu_offload=True on a run without a GPU" in _one_line(exc)


def test_several_ranks_expected_without_a_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as exc:
        setup_distributed("fsdp", 10.0)
    text = _one_line(exc)
    assert "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set" in text and "torchrun --nproc_per_node 2" in text


def test_a_checkpoint_of_another_engine_is_refused_naming_the_engine_to_resume_with(tmp_path):
    store = CheckpointStore(tmp_path)
    tmp = store.begin(4)
    (tmp / "trainer.pt").write_bytes(b"not read")
    store.finish(tmp, 4, {"world_size": 2, "engine": "fsdp"})
    trainer = Trainer(TinyLM(), TrainConfig(max_steps=8, progress=False), iter([]), run_dir=tmp_path)
    with pytest.raises(CheckpointError) as exc:
        trainer.fit(resume=True)
    text = _one_line(exc)
    assert "written by engine 'fsdp'" in text and "resume with engine='fsdp'" in text


class _Payload:
    """What an altered checkpoint could hold: unpickling it would call os.getpid (any callable would do)."""

    def __reduce__(self):
        import os

        return (os.getpid, ())


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_sharded_checkpoint_metadata_from_any_python_reads_its_paths(tmp_path, module):
    """The metadata holds paths, which Python 3.13 pickles as pathlib._local's classes and earlier ones as pathlib's:
    the reader takes both on any Python."""
    import io
    from pathlib import Path

    from trainloop.fsdp_checkpoint import _MetadataUnpickler

    # GLOBAL module.PosixPath, MARK, the string "shard", TUPLE, REDUCE, STOP: PosixPath("shard"), as either writes it.
    data = f"c{module}\nPosixPath\n(X\x05\x00\x00\x00shardtR.".encode("latin-1")
    assert _MetadataUnpickler(io.BytesIO(data)).load() == Path("shard")


def test_sharded_checkpoint_files_are_read_without_running_code(tmp_path):
    import io
    import pickle
    from types import SimpleNamespace

    from trainloop.fsdp_checkpoint import SafeLoadPlanner, SafeReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError) as exc:
        SafeReader(tmp_path).read_metadata()
    assert "posix.getpid is not a checkpoint metadata class" in _one_line(exc)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    buf = io.BytesIO()
    torch.save(_Payload(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.0.lr")), buf)
    buf = io.BytesIO()
    torch.save(0.01, buf)
    buf.seek(0)
    planner.load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.0.lr")), buf)
    assert planner.state_dict == {"optimizer.param_groups.0.lr": 0.01}


class Packed(torch.Tensor):
    """A stand-in for a quantized weight type with FSDP2's all-gather extension (torchao's NF4Tensor has one)."""

    def fsdp_pre_all_gather(self, mesh):
        raise NotImplementedError

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        raise NotImplementedError


def test_a_parameter_with_its_own_all_gather_must_split_into_equal_shards():
    from trainloop.engine_fsdp import check_even_shards

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(Packed), requires_grad=False)
    assert check_even_shards(model, 3) == [model[0].weight]  # plain tensors (the rest) FSDP pads as it likes
    with pytest.raises(ConfigError) as exc:
        check_even_shards(model, 2)
    text = _one_line(exc)
    assert "engine='fsdp' on 2 ranks: 0.weight (Packed, shape (3, 4)) does not split into 2 equal shards" in text
    assert "(3 rows)" in text and "engine='torch'" in text
