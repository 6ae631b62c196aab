"""Real runs in seconds for examples and tests: a little of the standard library's source prepared with a 400-piece
tokenizer (:func:`tiny_data`), and the tiny recipe trained a few steps on it (:func:`tiny_run`)."""

from __future__ import annotations

import os
from pathlib import Path

from lmtrain.corpus import build_corpus

TINY_CORPUS_BYTES, TINY_VOCAB_SIZE = 100_000, 400  # tiny_data: prepared in about a second


def tiny_data(directory: str | os.PathLike) -> Path:
    """``directory/data``: a little of the standard library's source (written to ``directory/input.txt``) prepared
    as `lmtrain prepare` does, with a tokenizer of 400 pieces. A real data directory in about a second, for examples.

    Example:
        >>> import json, tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> data = tiny_data(work.name)
        >>> json.loads((data / "meta.json").read_text())["vocab_size"], (data / "tokenizer.model").is_file()
        (400, True)
        >>> work.cleanup()
    """
    from lmtrain.prepare_data import prepare

    directory = Path(directory)
    build_corpus(directory / "input.txt", TINY_CORPUS_BYTES)
    prepare([directory / "input.txt"], directory / "data", vocab_size=TINY_VOCAB_SIZE, progress=False)
    return directory / "data"


def tiny_run(directory: str | os.PathLike, steps: int = 4) -> Path:
    """``directory/run``: the tiny preset without biases (so that it exports as MPT) trained ``steps`` steps on
    ``tiny_data(directory)``, evaluated and saved every 2 steps; the training log is not shown. Seconds on a CPU.

    Example:
        >>> import os, tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> run = tiny_run(work.name)
        >>> sorted(os.listdir(run / "checkpoints"))
        ['best.json', 'step_00000002', 'step_00000004']
        >>> work.cleanup()
    """
    from lmtrain.recipes import EXAMPLE_RECIPE
    from lmtrain.train_run import train

    data, run = tiny_data(directory), Path(directory) / "run"
    train(data, run, recipe=EXAMPLE_RECIPE, max_steps=steps, quiet=True,
          overrides={"bias": False, "eval_every": 2, "save_every": 2, "log_every": 1})  # fmt: skip
    return run
