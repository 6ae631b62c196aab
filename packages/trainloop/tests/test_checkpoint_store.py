"""CheckpointStore: what counts as a complete checkpoint, which one is chosen, what pruning may delete, and that
the toolkit's own state files never unpickle code."""

import json
import os
import pickle

import pytest
import torch
from tiny_model import SeqData, TinyLM

from trainloop import CheckpointError, CheckpointStore, TrainConfig, Trainer
from trainloop.checkpoint import load_torch, verify_checkpoint


def _cfg(**kw):
    base = dict(lr=1e-2, max_steps=6, micro_batch=4, save_every=2, keep_last=5, progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def _train(run_dir, resume=False, **kw):
    torch.manual_seed(0)
    return Trainer(TinyLM(), _cfg(**kw), SeqData(4), run_dir=run_dir).fit(resume=resume)


@pytest.fixture
def run(tmp_path):
    _train(tmp_path)  # checkpoints at steps 2, 4, 6
    return tmp_path


def _manifest(run, step):
    path = CheckpointStore(run).step_dir(step) / "manifest.json"
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(
    "entry, words",
    [("../../evil.pt", "outside the checkpoint"), ("/etc/passwd", "outside the checkpoint"), (None, "non-empty")],
)
def test_manifest_cannot_point_outside_or_be_empty(run, entry, words):
    path, manifest = _manifest(run, 6)
    manifest["files"] = {} if entry is None else {**manifest["files"], entry: "0" * 64}
    path.write_text(json.dumps(manifest))
    assert words in verify_checkpoint(path.parent)
    found, skipped = CheckpointStore(run).find_resumable()
    assert found.name == "step_00000004"  # fell back to the previous complete checkpoint
    assert skipped[0][0].name == "step_00000006" and words in skipped[0][1]


@pytest.mark.parametrize("content", ["[1, 2]", '{"files": {"a": "b"}}', "not json", '{"step": 6, "files": []}'])
def test_malformed_manifests_are_incomplete(run, content):
    path, _ = _manifest(run, 6)
    path.write_text(content)
    assert verify_checkpoint(path.parent) is not None
    assert CheckpointStore(run).resolve("latest")[0].name == "step_00000004"


@pytest.mark.parametrize(("field", "value"), [("world_size", "two"), ("world_size", 0), ("engine", 3)])
def test_manifest_fields_of_the_wrong_type_make_it_incomplete(run, field, value):
    path, manifest = _manifest(run, 6)
    path.write_text(json.dumps({**manifest, field: value}))
    assert f"malformed manifest ({field} {value!r}" in verify_checkpoint(path.parent)
    assert _train(run, resume=True, max_steps=7)["step"] == 7  # from step 4, the newest usable one


def test_sizes_by_default_hashes_on_request(run):
    ckpt = CheckpointStore(run).step_dir(6)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    weights.write_bytes(bytes(data))
    assert verify_checkpoint(ckpt, verify="sizes") is None
    assert "SHA-256 mismatch" in verify_checkpoint(ckpt, verify="full")
    weights.write_bytes(bytes(data[:-1]))
    assert "size mismatch" in verify_checkpoint(ckpt, verify="sizes")


def test_other_directory_names_are_ignored(run):
    store = CheckpointStore(run)
    (store.root / "step_00000020.bak").mkdir()
    (store.root / "step_99").mkdir()
    assert store.steps() == [2, 4, 6]
    assert store.resolve("latest")[0].name == "step_00000006"


def test_resolve_names(run):
    store = CheckpointStore(run)
    assert store.resolve(4)[0].name == store.resolve("4")[0].name == "step_00000004"
    assert store.resolve(str(store.step_dir(2)))[0] == store.step_dir(2)
    path, notes = store.resolve("best")
    assert path.name == "step_00000006" and "no evaluated best" in notes[0]
    with pytest.raises(CheckpointError, match="no checkpoint for step 5 .steps present: 2, 4, 6"):
        store.resolve(5)
    with pytest.raises(CheckpointError, match="not 'latest', 'best'"):
        store.resolve("newest")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointStore(run / "elsewhere").resolve("latest")


def test_a_fresh_run_refuses_a_directory_with_checkpoints(run):
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps 2..6\).*overwrite=True"):
        _train(run)
    assert CheckpointStore(run).steps() == [2, 4, 6]  # nothing deleted
    torch.manual_seed(0)
    Trainer(TinyLM(), _cfg(max_steps=2), SeqData(4), run_dir=run).fit(overwrite=True)
    assert CheckpointStore(run).steps() == [2]


def test_resume_from_an_older_checkpoint_never_prunes_newer_or_new_ones(tmp_path):
    _train(tmp_path, max_steps=10, keep_last=5)  # 2, 4, 6, 8, 10
    store = CheckpointStore(tmp_path)
    os.remove(store.step_dir(10) / "model.safetensors")  # a corrupt newest checkpoint
    torch.manual_seed(0)
    t = Trainer(TinyLM(), _cfg(max_steps=9, save_every=1, keep_last=1), SeqData(4), run_dir=tmp_path)
    t.fit(resume=True)
    assert t.skipped_checkpoints[0][0].name == "step_00000010"
    # Resumed at 8 and saved 9: the run's own newest checkpoint is kept, the corrupt step 10 is left alone.
    assert store.steps() == [9, 10] and store.resolve("latest")[0].name == "step_00000009"


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("name", ["trainer.pt", "rank0.pt"])
def test_state_files_are_loaded_without_unpickling_code(run, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = CheckpointStore(run).step_dir(6)
    with open(ckpt / name, "wb") as f:
        pickle.dump({"step": 6, "x": Payload()}, f)
    with pytest.raises(CheckpointError, match=f"{name}: refused to load"):
        load_torch(ckpt / name)
    assert not (tmp_path / "PWNED").exists()
    # Even with the manifest updated to match, a resume refuses the file with one line and runs nothing.
    from trainloop.checkpoint import sha256_file

    path, manifest = _manifest(run, 6)
    manifest["files"][name] = {"sha256": sha256_file(ckpt / name), "bytes": (ckpt / name).stat().st_size}
    path.write_text(json.dumps(manifest))
    torch.manual_seed(0)
    with pytest.raises(CheckpointError, match="refused to load"):
        Trainer(TinyLM(), _cfg(max_steps=8), SeqData(4), run_dir=run).fit(resume=True)
    assert not (tmp_path / "PWNED").exists()
