"""The fine-tuning workflow with commands only: pretrain -> finetune (LoRA) -> eval --prompts -> export, the export
loaded by transformers; a fine-tune stopped by SIGTERM and resumed gives the losses of one never stopped; and the
same command under torchrun on 2 CPU ranks."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import child_env, lmtrain_cmd, run_lmtrain, train_losses
from test_distributed import free_port, torchrun

pytestmark = pytest.mark.slow

FT = ["--seq-len", "128", "--lora-r", "4", "--set", "micro_batch=2", "--set", "log_every=1"]


@pytest.fixture(scope="module")
def base(prepared, tmp_path_factory) -> tuple[Path, Path]:
    """(a run pretrained 6 steps without biases, instruction pairs from the standard library)."""
    root = tmp_path_factory.mktemp("ft")
    run = root / "base"
    run_lmtrain("train", "--data", str(prepared), "--out", str(run), "--preset", "tiny", "--max-steps", "6",
                "--set", "bias=false", "--set", "eval_every=3", "--set", "save_every=3")  # fmt: skip
    pairs = root / "pairs.jsonl"
    from lmtrain.instructions import write_instructions

    write_instructions(pairs, max_pairs=120, max_chars=300)
    return run, pairs


def test_pretrained_to_finetuned_evaluated_exported(base, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sacrebleu")
    run, pairs = base
    tuned = tmp_path / "tuned"
    out = run_lmtrain("finetune", "--from", f"{run}:best", "--data", str(pairs), "--out", str(tuned), *FT,
                      "--max-steps", "4").stdout  # fmt: skip
    assert "trainable parameters:" in out and "chat template: tokens" in out
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in pairs.read_text().splitlines()[:3]]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                        {"role": "assistant", "content": r["response"]}]}) + "\n"
                               for r in rows))  # fmt: skip
    scores = json.loads(run_lmtrain("eval", "--run", str(tuned), "--prompts", str(prompts), "--max-new-tokens", "8",
                                    "--json").stdout.strip().splitlines()[-1])  # fmt: skip
    assert scores["count"] == 3 and Path(scores["generations"]).is_file()
    export = tmp_path / "hf"
    run_lmtrain("export", "--run", str(tuned), "--out", str(export), "--format", "hf", "--merge-lora")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=False)  # fmt: skip
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    assert (tokens[0], tokens[-2], tokens[-1]) == ("<|user|>", "<|end|>", "<|assistant|>")
    assert model(ids).logits.shape[1] == ids.shape[1]


def test_sigterm_then_resume_gives_the_same_losses(base, tmp_path):
    run, pairs = base
    args = ["finetune", "--from", f"{run}:best", "--data", str(pairs), *FT, "--max-steps", "24",
            "--set", "save_every=4", "--lora-dropout", "0.1"]  # fmt: skip
    reference = tmp_path / "reference"
    run_lmtrain(*args, "--out", str(reference))
    expected = train_losses(reference)
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(lmtrain_cmd(*args, "--out", str(stopped)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    deadline = time.monotonic() + 300
    while max(train_losses(stopped), default=0) < 6:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    stopped_at = max(train_losses(stopped))
    assert stopped_at < 24, "the signal should stop the run before its end"
    run_lmtrain(*args, "--out", str(stopped), "--resume")
    got = train_losses(stopped)
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert math.isclose(got[step], loss, rel_tol=1e-6, abs_tol=1e-7), (step, stopped_at, got[step], loss)


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_finetune_under_torchrun(base, tmp_path, engine):
    run, pairs = base
    out = tmp_path / "ranks"
    cmd = torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "lmtrain", "finetune", "--from", f"{run}:best", "--data", str(pairs), "--out", str(out),
                   *FT, "--max-steps", "3", "--engine", engine)  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(train_losses(out)) == [1, 2, 3]
    manifest = json.loads((out / "checkpoints" / "step_00000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest.get("engine", "torch") == engine
    if engine == "torch":
        assert {"rank0.pt", "rank1.pt"} <= set(manifest["files"])
    # The adapters file holds whole adapters (gathered from the shards under fsdp), equal to the final checkpoint's.
    from safetensors.torch import load_file

    from lmcore import lora_state
    from lmtrain.run_files import load_trained_model

    adapters = load_file(str(out / "adapters.safetensors"))
    model, _, _ = load_trained_model(out, checkpoint="latest")
    assert adapters.keys() == lora_state(model).keys()
    assert all(torch.equal(adapters[k], v) for k, v in lora_state(model).items())
    assert any(float(v.abs().sum()) > 0 for k, v in adapters.items() if k.endswith("lora_B"))  # B starts at zero
