import json

import numpy as np
import torch
from tiny_model import SeqData, TinyLM

from trainloop import TrainConfig, Trainer, calibrate


def test_calibrate_writes_percentile_thresholds_that_train_accepts(tmp_path):
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
    cfg2 = TrainConfig(max_steps=2, clip_groups=str(out), progress=False, tensorboard=False, log_every=1)
    Trainer(TinyLM(), cfg2, SeqData(4), run_dir=tmp_path / "train").fit()
    rec = json.loads((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"grad_norm/embed.*", "grad_norm/o_proj.*", "grad_norm/*"} <= set(rec)


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
