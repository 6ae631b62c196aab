"""The original recipe's data path: `train --set sampler=dynamic` (tokbin's DynamicLength) and `prepare --clean`."""

from __future__ import annotations

import json

import pytest
from trained_runs import tiny_run

import tokbin
from lmtrain import prepare, train
from tokbin.tokenizer import load_processor


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_run(tmp_path_factory).parent / "data"


def test_train_with_the_dynamic_sampler(data, tmp_path):
    from lmtrain.train_run import sampler_for

    summary = train(data, tmp_path / "run", recipe="tiny", max_steps=3, quiet=True,
                    overrides={"sampler": "dynamic", "seq_len": 128, "cpu_threads": 1, "log_every": 1})  # fmt: skip
    assert summary.step == 3
    assert json.loads((tmp_path / "run" / "run.json").read_text())["data_config"]["sampler"] == "dynamic"
    sampler = sampler_for(summary.plan, tokbin.open_tokens(data / "train.bin"))
    assert isinstance(sampler, tokbin.DynamicLength)
    # Tokens per batch stay constant while the length follows the documents drawn: 32 (short) or 128 tokens.
    shapes = {(len(starts), seq) for starts, seq in (sampler.batch(i) for i in range(50))}
    assert {seq for _, seq in shapes} == {32, 128}
    assert {rows * seq for rows, seq in shapes} == {summary.plan.train.micro_batch * 128}


def test_prepare_clean_strips_markup(tmp_path):
    text = "".join(f"<p>Paragraph {i} of <b>bold</b> text [12] with   spaces.</p>\n\n" for i in range(400))
    (tmp_path / "web.txt").write_text(text)
    for clean in (False, True):
        out = tmp_path / f"data-{clean}"
        prepare([str(tmp_path / "web.txt")], out, vocab_size=300, progress=False, clean=clean)
        sp = load_processor(out / "tokenizer.model")
        decoded = sp.decode(tokbin.open_tokens(out / "train.bin").tokens[:400].tolist())
        assert ("<b>" in decoded) != clean and ("[12]" in decoded) != clean
