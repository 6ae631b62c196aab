import fnmatch
import json

import numpy as np
import pytest
import torch
from tiny_model import SeqData, TinyLM

from trainloop import ClipGroups, TrainConfig, Trainer, calibrate


def _group_norms(model, thresholds):
    """Per-pattern norms of the gradients now in the model (first matching pattern wins, as in clip_groups)."""
    sq = dict.fromkeys(thresholds, 0.0)
    for name, p in model.named_parameters():
        group = next(pat for pat in thresholds if fnmatch.fnmatchcase(name, pat))
        sq[group] += float(p.grad.double().pow(2).sum())
    return {g: v**0.5 for g, v in sq.items()}


@pytest.mark.parametrize("fault", [None, "thresholds_not_applied"])
def test_calibrate_writes_percentile_thresholds_that_train_accepts(tmp_path, monkeypatch, fault):
    if fault == "thresholds_not_applied":  # measured and logged, never applied: the clipping check must fail
        real_clip = ClipGroups.clip
        monkeypatch.setattr(ClipGroups, "clip", lambda self, named, **kw: real_clip(self, named, **kw, apply=False))
    torch.manual_seed(0)
    cfg = TrainConfig(lr=1e-2, max_steps=20, micro_batch=4, progress=False, tensorboard=False, log_every=5)
    out = tmp_path / "clip.json"
    result = calibrate(TinyLM(), cfg, SeqData(4), run_dir=tmp_path / "cal", patterns=["embed.*", "o_proj.*"],
                       at_step=5, n_batches=12, percentile=90, out=out)  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["at_step"] == 5 and saved["n_batches"] == 12
    assert list(saved["thresholds"]) == ["embed.*", "o_proj.*", "*"]
    for group, values in saved["norms"].items():
        assert len(values) == 12 and len(set(values)) > 1  # different batches, different norms
        assert saved["thresholds"][group] == np.percentile(values, 90)
    assert result["thresholds"] == saved["thresholds"]
    # Train with the file: the gradients the optimizer steps on are each group's, clipped to its threshold.
    thresholds = saved["thresholds"]
    cfg2 = TrainConfig(lr=1e-2, max_steps=12, clip_groups=str(out), progress=False, tensorboard=False, log_every=1)
    torch.manual_seed(0)
    model = TinyLM()
    trainer = Trainer(model, cfg2, SeqData(4), run_dir=tmp_path / "train")
    stepped = []
    real_step = trainer.engine._step
    trainer.engine._step = lambda: (stepped.append(_group_norms(model, thresholds)), real_step())
    trainer.fit()
    recs = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(stepped) == len(recs) == 12
    over = [(r["step"], g) for r in recs for g in thresholds if r[f"grad_norm/{g}"] > thresholds[g] * 1.01]
    assert over, "no step had a norm over its threshold: nothing here would show clipping"
    excess = [(s, g, post[g] / thresholds[g]) for s, post in enumerate(stepped, 1) for g in thresholds
              if post[g] > thresholds[g] * (1 + 1e-4)]  # fmt: skip
    if fault is None:
        assert not excess, excess
        for step, g in over:  # clipped to the threshold itself, not below it
            assert stepped[step - 1][g] == pytest.approx(thresholds[g], rel=1e-4)
    else:
        assert excess  # the check above catches thresholds that are loaded but not applied


def test_gradient_inspector_tables_and_histograms(tmp_path):
    torch.manual_seed(0)
    cfg = TrainConfig(max_steps=3, inspect_steps=[2], progress=False, tensorboard=False, clip=0.0)
    model = TinyLM()
    seen = {}

    trainer = Trainer(model, cfg, SeqData(4), run_dir=tmp_path)
    orig = trainer.engine._step  # the optimizer step itself: the gradients the inspector saw, clipped (clip=0: not)

    def step_and_record():
        if trainer.step == 1:
            seen.update({n: p.grad.norm().item() for n, p in model.named_parameters()})
        orig()

    trainer.engine._step = step_and_record
    trainer.fit()
    rows = (tmp_path / "inspect" / "grads_step2.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:4] == ["name", "group", "shape", "norm"]
    table = {r.split("\t")[0]: float(r.split("\t")[3]) for r in rows[1:]}
    assert set(table) == set(seen)
    for name, norm in table.items():
        assert abs(norm - seen[name]) <= 1e-5 * max(norm, 1e-12), name
    assert (tmp_path / "inspect" / "grads_step2.png").stat().st_size > 1000
    assert not (tmp_path / "inspect" / "grads_step1.tsv").exists()
