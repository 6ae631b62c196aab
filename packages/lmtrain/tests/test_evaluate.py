import json
import math
import os

import pytest
import torch

from lmtrain.errors import LmtrainError
from lmtrain.evaluate import metrics_from_nll, sliding_window_nll, text_stats, window_plan


@pytest.mark.parametrize("n,context,stride,offset", [(10, 4, 2, 0), (100, 16, 5, 3), (7, 32, 16, 0), (50, 8, 8, 7)])
def test_window_plan_scores_every_target_once(n, context, stride, offset):
    scored = []
    for start, end, first in window_plan(n, context, stride, offset):
        assert end - start <= context and start <= first < end
        scored.extend(range(first, end))
    assert scored == list(range(n))


def test_window_plan_rejects_stride_above_context():
    with pytest.raises(LmtrainError, match="stride"):
        window_plan(10, 4, 5)


class Bigram(torch.nn.Module):
    """Logits depend only on the current token, so the sliding-window NLL must equal the full-sequence one (which
    checks the counting and masking, never the context: the test below does)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, ids):
        from lmcore import LMOutput

        return LMOutput(self.table[ids], None)


def test_sliding_window_nll_matches_direct_sum():
    torch.manual_seed(0)
    model = Bigram(11)
    tokens = torch.randint(0, 11, (57,))
    with torch.no_grad():
        direct = torch.nn.functional.cross_entropy(model.table[tokens[:-1]], tokens[1:], reduction="sum")
    for context, stride in ((8, 4), (16, 16), (100, 50)):
        nll, n = sliding_window_nll(model, tokens, context, stride, batch_size=3)
        assert n == 56
        assert math.isclose(nll, float(direct), rel_tol=1e-5)


def _context_model():
    """lmcore's tiny GPT with weights far from init, so each logit depends strongly on the tokens before it (at
    init the logits are near uniform and a window given the wrong context scores almost the same)."""
    from lmcore import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset("tiny")).eval()
    for p in model.parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def _windowwise_nll(model, tokens, context, stride):
    """One forward per window, batch 1: windows end every `stride` tokens after the first `context`, each sees the
    `context` tokens up to its end and scores the targets after the previous window's end."""
    n = tokens.numel() - 1
    ends = [min(context, n)]
    while ends[-1] < n:
        ends.append(min(ends[-1] + stride, n))
    total, prev = 0.0, 0
    with torch.no_grad():
        for end in ends:
            start = max(0, end - context)
            logits = model(tokens[None, start:end]).logits[0].double()  # (end - start, V)
            nll = torch.nn.functional.cross_entropy(logits, tokens[start + 1 : end + 1], reduction="none")
            total += float(nll[prev - start :].sum())
            prev = end
    return total, n


@pytest.mark.parametrize("fault", [None, "windows_without_context"])
def test_sliding_window_nll_gives_each_window_its_context(monkeypatch, fault):
    if fault == "windows_without_context":  # every target still scored once, but from its window's first target on
        real_plan = window_plan
        monkeypatch.setattr(
            "lmtrain.evaluate.window_plan", lambda n, c, s, offset=0: [(f, e, f) for _, e, f in real_plan(n, c, s)]
        )
    model = _context_model()
    tokens = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(1))
    for context, stride, batch in ((16, 8, 3), (32, 5, 4), (12, 12, 2)):
        expected, n = _windowwise_nll(model, tokens, context, stride)
        nll, scored = sliding_window_nll(model, tokens, context, stride, batch_size=batch)
        assert scored == n == 89
        if fault is None:
            assert math.isclose(nll, expected, rel_tol=1e-5), (context, stride, nll, expected)
        elif stride < context:  # the wrong context moves the loss by over 10x the tolerance above
            assert not math.isclose(nll, expected, rel_tol=1e-4), (context, stride, nll, expected)
    if fault is not None:  # the bigram test above cannot see it: its logits ignore the context
        test_sliding_window_nll_matches_direct_sum()


def test_metrics_from_nll():
    stats = text_stats("to be\nor not\n")
    assert stats == {"bytes": 13, "words": 6}
    m = metrics_from_nll(nll=10.0, tokens=5, stats=stats)
    assert math.isclose(m["loss"], 2.0) and math.isclose(m["token_ppl"], math.exp(2.0))
    assert math.isclose(m["bits_per_byte"], 10.0 / math.log(2) / 13)
    assert math.isclose(m["word_ppl"], math.exp(10.0 / 6))


# ---------------------------------------------------------------------------------------------- the commands
# On a tiny trained run (trained_runs.py): device, precision, checkpoint choice and torchrun.


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from trained_runs import tiny_run

    return tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def val_text(run):
    text = run.parent / "input.txt"
    val = run.parent / "val.txt"
    val.write_text(text.read_text(encoding="utf-8")[-6000:], encoding="utf-8")  # about 200 windows of 32
    return val


def eval_json(capsys, run, val, *flags: str) -> dict:
    from lmtrain.cli import main

    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--text", str(val), "--json", "--context", "32", "--stride", "16",
                 *flags]) == 0  # fmt: skip
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "command,flags,named",
    [
        ("eval", ["--device", "cuda"], "--device cuda: no CUDA device is visible"),
        ("generate", ["--device", "cuda:0"], "--device cuda:0: no CUDA device is visible"),
        ("eval", ["--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
        ("eval", ["--dtype", "fp16", "--device", "cpu"], "--dtype fp16 needs a GPU"),
        ("generate", ["--dtype", "fp8"], "--dtype 'fp8': expected one of fp32, bf16, fp16"),
        ("eval", ["--checkpoint", "7"], "no checkpoint for step 7 (steps present: 2, 4)"),
        ("generate", ["--checkpoint", "nowhere"], "checkpoint 'nowhere': not 'latest', 'best'"),
    ],
)
def test_bad_device_dtype_or_checkpoint_is_one_line_exit_2(run, val_text, capsys, command, flags, named):
    from lmtrain.cli import main

    if "cuda" in flags[1] and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    target = ["--text", str(val_text)] if command == "eval" else ["--prompt", "def"]
    capsys.readouterr()
    assert main([command, "--run", str(run), *target, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmtrain {command}: error: ") and named in err[0], err


def test_eval_and_generate_pick_the_checkpoint_and_say_what_they_fell_back_to(run, val_text, capsys, tmp_path):
    import shutil

    from trained_runs import variant_run

    from lmtrain.sample import generate_text

    best = json.loads((run / "checkpoints" / "best.json").read_text())["checkpoint"]
    assert eval_json(capsys, run, val_text)["checkpoint"].endswith(best)  # default: the best evaluated
    by_step = {step: eval_json(capsys, run, val_text, "--checkpoint", str(step)) for step in (2, 4)}
    assert by_step[2]["loss"] != by_step[4]["loss"]
    assert eval_json(capsys, run, val_text, "--checkpoint", "latest")["loss"] == by_step[4]["loss"]

    from lmtrain.run_files import load_trained_model

    model = load_trained_model(run, checkpoint=2)[0]
    copy = variant_run(run, tmp_path / "run", {2: model})  # no evaluation: best falls back to the latest
    capsys.readouterr()
    result = eval_json(capsys, copy, val_text)
    assert result["loss"] == pytest.approx(by_step[2]["loss"], rel=1e-12)
    notes = []
    sample = generate_text(str(copy), "def", max_new_tokens=5, temperature=0, on_note=notes.append)
    assert notes == ["no evaluated best checkpoint in this run; using the latest"]
    assert sample == generate_text(str(run), "def", max_new_tokens=5, temperature=0, checkpoint="2")

    shutil.copytree(run / "checkpoints", copy / "checkpoints", dirs_exist_ok=True)  # best.json -> step 4
    (copy / "checkpoints" / best / "model.safetensors").write_bytes(b"truncated")
    from lmtrain.cli import main

    capsys.readouterr()
    assert main(["eval", "--run", str(copy), "--text", str(val_text), "--json", "--context", "32"]) == 0
    captured = capsys.readouterr()
    assert f"best checkpoint {best} is unusable" in captured.err and "using the latest" in captured.err
    assert json.loads(captured.out)["checkpoint"].endswith("step_00000002")  # the newest complete one


def test_bf16_eval_is_close_to_fp32(run, val_text, capsys):
    fp32 = eval_json(capsys, run, val_text)
    bf16 = eval_json(capsys, run, val_text, "--dtype", "bf16", "--device", "cpu")
    assert bf16["dtype"] == "bf16" and bf16["device"] == "cpu"
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=1e-2) and bf16["loss"] != fp32["loss"]


def test_two_ranks_under_torchrun_give_the_one_process_figures(run, val_text, capsys):
    import socket
    import subprocess
    import sys

    one = eval_json(capsys, run, val_text, "--seeds", "0", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # "--" ends torchrun's own options: its parser would take lmtrain's --run for an abbreviation of --run-path.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "-m",
               "--", "lmtrain", "eval", "--run", str(run), "--text", str(val_text), "--json", "--context", "32",
               "--stride", "16", "--seeds", "0", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 prints, rank 1 does not
    two = json.loads(lines[0])
    assert two["ranks"] == 2 and one["ranks"] == 1 and two["tokens"] == one["tokens"]
    for key in ("loss", "bits_per_byte", "loss_std"):
        assert two[key] == pytest.approx(one[key], rel=1e-6)
    assert [r["loss"] for r in two["runs"]] == pytest.approx([r["loss"] for r in one["runs"]], rel=1e-6)
