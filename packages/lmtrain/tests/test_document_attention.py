"""`lmtrain train --document-attention`: the model's document_separator from the token file's EOS id."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tokbin
from lmtrain.cli import main
from lmtrain.errors import LmtrainError
from lmtrain.plan import DataInfo, TrainRequest, World, document_separator_of, plan_run

VOCAB = 300


def token_data(directory: Path, eos_id: int | None) -> Path:
    """A data directory with tiny train/val token files (the tokenizer is never read by plan_run)."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, VOCAB, size=n) for n in (40, 25, 60)]
    if eos_id is not None:
        docs = [np.append(d, eos_id) for d in docs]
    for name in ("train.bin", "val.bin"):
        tokbin.write_tokens(directory / name, docs, vocab_size=VOCAB, eos_id=eos_id)
    meta = {"tokenizer": "tokenizer.model", "vocab_size": VOCAB, "eos_id": eos_id,
            "train": {"file": "train.bin"}, "val": {"file": "val.bin"}}  # fmt: skip
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def model_config(data: Path, **request):
    """The model config lmtrain would plan for `request` on `data`."""
    from lmtrain.run_files import read_meta

    request = TrainRequest(data=str(data), out=str(data.parent / "run"), **request)
    return plan_run(request, DataInfo(read_meta(data), 100), World(threads_fixed=True)).model


def test_flag_sets_the_separator_to_the_token_files_eos_id(tmp_path):
    data = token_data(tmp_path / "data", eos_id=2)
    assert model_config(data, recipe="tiny").document_separator is None
    assert model_config(data, recipe="tiny", document_attention=True).document_separator == 2
    assert document_separator_of(str(data / "train.bin")) == 2


def test_set_reaches_the_field_and_conflicts_with_the_flag(tmp_path):
    data = token_data(tmp_path / "data", eos_id=2)
    assert model_config(data, recipe="tiny", overrides={"document_separator": "7"}).document_separator == 7
    with pytest.raises(LmtrainError, match="use one"):
        model_config(data, recipe="tiny", document_attention=True, overrides={"document_separator": 7})
    with pytest.raises(LmtrainError, match="document_separator"):
        model_config(data, recipe="tiny", overrides={"document_separator": VOCAB})  # outside the vocabulary


def test_token_file_without_eos_is_a_one_line_error(tmp_path, capsys):
    data = token_data(tmp_path / "data", eos_id=None)
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--document-attention"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--document-attention" in err and "no EOS id" in err and "train.bin" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """30,000 characters of this Python's standard-library source (the demo's corpus), prepared."""
    from lmtrain.corpus import build_corpus
    from lmtrain.prepare_data import prepare

    root = tmp_path_factory.mktemp("doc")
    text = root / "input.txt"
    build_corpus(text, 60_000)  # stops near its target, not past it: ask for twice what is kept
    text.write_text(text.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    prepare([str(text)], root / "data", vocab_size=400, progress=False)  # 256 byte pieces + merges
    return root


def test_run_keeps_the_separator_for_eval_and_generate(prepared, tmp_path, capsys, monkeypatch):
    from lmcore import GPT, ModelConfig
    from lmcore import generate as real_generate
    from lmtrain.evaluate import evaluate_text
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.sample import generate_text
    from lmtrain.text_codec import decode, encode

    run = tmp_path / "run"
    args = ["train", "--data", str(prepared / "data"), "--out", str(run), "--preset", "tiny", "--document-attention",
            "--max-steps", "3", "--set", "cpu_threads=1", "--set", "log_every=1", "--set", "save_every=3"]  # fmt: skip
    assert main(args) == 0
    eos = tokbin.TokenFile(prepared / "data" / "train.bin").eos_id
    model, run_info, _ = load_trained_model(run)
    assert eos is not None and model.config.document_separator == eos == run_info.eos_id

    # eval uses the checkpoint's config: its figure is the document-attention model's, not the plain one's.
    val = prepared / "val.txt"
    val.write_text("ROMEO:\nWhat light through yonder window breaks?\n" * 3, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--text", str(val), "--json", "--context", "32", "--stride", "16"]) == 0
    reported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
    sp, text = load_tokenizer(run), val.read_text(encoding="utf-8")
    plain = GPT(ModelConfig.from_dict({**model.config.to_dict(), "document_separator": None}))
    plain.load_state_dict(model.state_dict())
    kwargs = dict(context=32, stride=16, eos_id=eos)
    # Only the first window differs (the EOS in front is a document of its own), by about 3e-5 after 3 steps;
    # the same weights and inputs on CPU reproduce the reported figure to rounding.
    assert reported == pytest.approx(evaluate_text(model, sp, text, **kwargs)["loss"], rel=1e-9)
    assert abs(reported - evaluate_text(plain.eval(), sp, text, **kwargs)["loss"]) > 1e-6

    # generate: the prompt goes to the cache without the EOS in front, so cached decoding (plain causal attention)
    # sees what the document-attention forward of [EOS, prompt] gives the prompt's positions.
    import lmcore

    prompts = []
    monkeypatch.setattr(
        lmcore, "generate", lambda m, ids, *a, **k: prompts.append(ids) or real_generate(m, ids, *a, **k)
    )
    prompt = "ROMEO:"
    text_out = generate_text(str(run), prompt, max_new_tokens=6, temperature=0)
    assert prompts[0].tolist() == [encode(sp, prompt)]
    ids = [eos] + encode(sp, prompt)
    with torch.no_grad():
        cached = model(prompts[0], kv_cache=lmcore.KVCache(model.config.n_layer)).logits[0]
        torch.testing.assert_close(cached, model(torch.tensor([ids])).logits[0, 1:], rtol=1e-5, atol=1e-5)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[len(encode(sp, prompt)) + 1 :]
    assert text_out == prompt + decode(sp, new[: new.index(eos)] if eos in new else new)


def test_a_compiled_document_attention_run_trains_as_the_eager_one(prepared, tmp_path):
    """`--compile` (fullgraph: a graph break is an error) with `--document-attention`: the same losses as eager."""

    def losses(name, *extra):
        run = tmp_path / name
        args = ["train", "--data", str(prepared / "data"), "--out", str(run), "--preset", "tiny",
                "--document-attention", "--max-steps", "3", "--set", "cpu_threads=1", "--set", "log_every=1",
                "--set", "dropout=0", *extra]  # fmt: skip
        assert main(args) == 0
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in records if "loss" in r and "step" in r]

    eager = losses("eager")
    assert len(eager) == 3
    assert losses("compiled", "--compile") == pytest.approx(eager, rel=1e-5)
