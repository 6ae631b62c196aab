"""prepare -> train -> eval -> generate on standard-library source at the tiny size, through the installed CLI."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_metrics, run_lmtrain


def _windowed_nll(run, text: str, context: int, stride: int) -> tuple[float, int]:
    """Total NLL (nats) and scored tokens of `text` under the run's best checkpoint: the end-of-document id, then the
    text's SentencePiece ids; windows end every `stride` tokens after the first `context`, one forward each."""
    import sentencepiece as spm
    import torch

    from lmtrain.run_files import load_trained_model

    model, info, _ = load_trained_model(run, checkpoint="best")
    sp = spm.SentencePieceProcessor(model_file=str(run / "tokenizer.model"))
    ids = torch.tensor([info.eos_id, *sp.encode(text)])
    n = ids.numel() - 1
    ends = [min(context, n)]
    while ends[-1] < n:
        ends.append(min(ends[-1] + stride, n))
    total, prev = 0.0, 0
    with torch.no_grad():
        for end in ends:
            start = max(0, end - context)
            logits = model(ids[None, start:end]).logits[0].double()  # (end - start, V)
            nll = torch.nn.functional.cross_entropy(logits, ids[start + 1 : end + 1], reduction="none")
            total += float(nll[prev - start :].sum())
            prev = end
    return total, n


def test_prepare_writes_meta_with_counts(prepared, texts):
    meta = json.loads((prepared / "meta.json").read_text())
    train, val = texts
    assert meta["vocab_size"] == 512
    assert meta["train"]["bytes"] == train.stat().st_size
    assert meta["val"]["bytes"] == val.stat().st_size
    for split in ("train", "val"):
        info = meta[split]
        assert info["tokens"] > 0
        assert math.isclose(info["bytes_per_token"], info["bytes"] / info["tokens"])
        assert (prepared / info["file"]).is_file()
    # BPE packs more than one byte into a token.
    assert 1.5 < meta["train"]["bytes_per_token"] < 5


def test_train_eval_generate(prepared, texts, tmp_path):
    _, val = texts
    run = tmp_path / "run"
    run_lmtrain(
        "train", "--data", str(prepared), "--out", str(run), "--preset", "tiny", "--max-steps", "60",
        "--set", "log_every=10", "--set", "lr=0.01", "--set", "save_every=30", "--gpumon",
    )  # fmt: skip
    records = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r)
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, "the loss should fall"
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "tokenizer.model").is_file()
    # gpumon records the host (CPU, RSS) where there is no GPU driver, into a file named after the host.
    (recording,) = run.glob("gpumon.*.csv")
    assert len(recording.read_text().splitlines()) > 2

    result = run_lmtrain("eval", "--run", str(run), "--text", str(val), "--json", "--context", "32", "--stride", "16")
    ev = json.loads(result.stdout.strip().splitlines()[-1])
    text = val.read_text(encoding="utf-8")
    assert ev["bytes"] == len(text.encode("utf-8"))
    assert ev["words"] == len(text.split()) + text.count("\n")
    assert ev["lossless_encoding"] is True
    # The figures recomputed here from the checkpoint and the tokenizer, not from the command's own output.
    nll, tokens = _windowed_nll(run, text, context=32, stride=16)
    assert ev["tokens"] == tokens
    assert math.isclose(ev["loss"], nll / tokens, rel_tol=1e-5)
    assert math.isclose(ev["bits_per_byte"], nll / math.log(2) / len(text.encode("utf-8")), rel_tol=1e-5)
    assert math.isclose(ev["token_ppl"], math.exp(nll / tokens), rel_tol=1e-5)
    assert math.isclose(ev["word_ppl"], math.exp(nll / (len(text.split()) + text.count("\n"))), rel_tol=1e-5)
    # Trained, it beats a uniform guess over the vocabulary by a clear margin.
    assert ev["loss"] < math.log(512) - 1.0

    # Protocol: repeats agree on CPU; seeds shift the window grid, so they differ a little.
    result = run_lmtrain(
        "eval", "--run", str(run), "--text", str(val), "--json", "--context", "32", "--stride", "16",
        "--repeat", "2", "--seeds", "1", "2",
    )  # fmt: skip
    proto = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(proto["runs"]) == 4
    assert proto["runs"][0]["loss"] == proto["runs"][1]["loss"]
    assert proto["loss_std"] >= 0 and abs(proto["loss"] - ev["loss"]) < 0.1

    prompt = "def main("
    out = run_lmtrain("generate", "--run", str(run), "--prompt", prompt, "--max-new-tokens", "30", "--seed", "0")
    assert out.stdout.startswith(prompt)
    assert len(out.stdout.strip()) > len(prompt)
    again = run_lmtrain("generate", "--run", str(run), "--prompt", prompt, "--max-new-tokens", "30", "--seed", "0")
    assert again.stdout == out.stdout, "the same seed must give the same sample"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("log_evry=1", ("log_evry", "log_every")),  # an unknown field, with the near match suggested
        ("precision=fp8", ("precision", "fp8")),  # a bad value, naming the field and the value
    ],
)
def test_set_rejects_bad_overrides_naming_them(prepared, tmp_path, override, named):
    result = run_lmtrain(
        "train", "--data", str(prepared), "--out", str(tmp_path / "r"), "--preset", "tiny", "--set", override,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert all(word in result.stderr for word in named)
