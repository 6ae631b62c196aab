"""Run directories for the eval, generate and export tests.

`tiny_run` prepares 30,000 characters of this Python's standard-library source and trains the tiny preset without
biases (so it exports as MPT) for 4 steps, once per test session. `variant_run` copies its run.json and tokenizer
next to checkpoints written with trainloop's CheckpointStore from any model, the way training writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_CACHE: dict[str, Path] = {}


def tiny_run(tmp_path_factory) -> Path:
    """A trained run (checkpoints at steps 2 and 4, each evaluated; best.json points at the better one)."""
    if "run" not in _CACHE:
        from lmtrain import train
        from lmtrain.corpus import build_corpus
        from lmtrain.prepare_data import prepare

        root = tmp_path_factory.mktemp("tiny_run")
        text = root / "input.txt"
        build_corpus(text, 60_000)  # stops near its target, not past it: ask for twice what is kept
        text.write_text(text.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
        prepare([str(text)], root / "data", vocab_size=400, progress=False)
        run = root / "run"
        settings = {"bias": False, "cpu_threads": 1, "save_every": 2, "eval_every": 2, "log_every": 1}
        train(root / "data", run, recipe="tiny", max_steps=4, quiet=True, overrides=settings)
        _CACHE["run"] = run
    return _CACHE["run"]


def variant_run(source: Path, out: Path, models: dict[int, object], best: int | None = None) -> Path:
    """A run directory with `source`'s run.json and tokenizer and one checkpoint per (step, GPT) of `models`."""
    from trainloop.checkpoint import CheckpointStore

    out.mkdir(parents=True)
    shutil.copy(source / "tokenizer.model", out / "tokenizer.model")
    run = json.loads((source / "run.json").read_text())
    store = CheckpointStore(out)
    for step, model in models.items():
        run["model_config"] = model.config.to_dict()
        tmp = store.begin(step)
        model.save_pretrained(tmp)
        store.finish(tmp, step)
    if best is not None:
        store.mark_best(best, "eval_loss", 1.0)
    (out / "run.json").write_text(json.dumps(run))
    return out
