"""`lmtrain doctor --from DIR`: which of full fine-tuning, LoRA and QLoRA of a Hugging Face model fits a card, from
its config.json alone, with lmcore's figures; and one line for each bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lmcore
from lmcore.hf_llama import config_from_hf
from lmtrain.cli import main

GIB = 2**30
# The shape fields of Qwen2-1.5B's published config.json (a Qwen2 puts biases on q, k and v: no field says it).
QWEN2_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
}
N_PARAMS = 1_543_714_304  # 28 x 47,151,616 per layer + 151,936 x 1,536 (tied) + 1,536 (final norm)


def _model_dir(tmp_path: Path, config: dict | None = None) -> Path:
    directory = tmp_path / "qwen2-1.5b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config or QWEN2_1_5B))
    return directory


def _doctor(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(["doctor", *argv])
    out, err = capsys.readouterr()
    assert err == ""
    return status, out.splitlines()


def _rows(lines: list[str]) -> dict[tuple[str, str, str], list[str]]:
    """(method, layout, checkpointing) -> the five figures and the verdict."""
    out = {}
    for line in lines:
        words = line.split()
        if words and words[0] in ("full", "lora", "qlora") and len(words) >= 8:
            layout = "one GPU" if words[1] == "one" else f"FSDP x {words[3]}"
            ckpt, *rest = words[3:] if words[1] == "one" else words[4:]
            out[(words[0], layout, ckpt)] = rest
    return out


def test_qwen2_1_5b_full_does_not_fit_one_3090_lora_and_qlora_do(tmp_path, capsys):
    status, lines = _doctor(capsys, "--from", str(_model_dir(tmp_path)), "--micro-batch", "1", "--seq-len", "512")
    assert status == 0
    assert lines[0].startswith(f"Qwen2ForCausalLM from {tmp_path}/qwen2-1.5b/config.json: 1,543,714,304 parameters "
                               "(28 layers, width 1536, 12 heads, 2 key/value heads, SwiGLU width 8960")  # fmt: skip
    assert lines[1].startswith("micro-batch 1 (--micro-batch) x 512 tokens (--seq-len), bf16, 24 GiB per GPU; LoRA "
                               "and QLoRA r=8 on q, k, v, o (finetune's defaults)")  # fmt: skip
    rows = _rows(lines)
    # Arithmetic: full fine-tuning holds 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and
    # Adam's two moments): 23.0 GiB before any activation, past 90% of 24 GiB with or without checkpointing.
    assert 16 * N_PARAMS / GIB > 0.9 * 24
    assert rows[("full", "one GPU", "off")][-1] == rows[("full", "one GPU", "block")][-1] == "no"
    # LoRA: the bf16 base is 2 bytes per parameter (2.9 GiB); QLoRA's NF4 linears about half a byte per weight.
    assert rows[("lora", "one GPU", "off")][0] == f"{2 * N_PARAMS / GIB + 4 * 2_179_072 / GIB:.2f}"
    assert rows[("lora", "one GPU", "off")][-1] == rows[("qlora", "one GPU", "off")][-1] == "yes"
    assert float(rows[("qlora", "one GPU", "off")][0]) < float(rows[("lora", "one GPU", "off")][0]) / 2
    # Under FSDP on two cards the 16 bytes per parameter halve: full fine-tuning fits.
    assert rows[("full", "FSDP x 2", "off")][-1] == "yes"
    assert "one GPU: fits: lora, qlora; does not fit: full" in lines
    assert "2 GPUs under FSDP (--engine fsdp): fits: full, lora, qlora" in lines


def test_the_figures_are_lmcores_estimates_at_finetunes_defaults(tmp_path, capsys):
    status, lines = _doctor(capsys, "--from", str(_model_dir(tmp_path)))
    assert status == 0
    assert lines[1].startswith("micro-batch 8 (finetune's default) x 1024 tokens (finetune's default for a base)")
    config = config_from_hf(QWEN2_1_5B)
    rows = _rows(lines)
    assert {(m, layout) for m, layout, _ in rows} == {(m, w) for m in ("full", "lora", "qlora")
                                                       for w in ("one GPU", "FSDP x 2")}  # fmt: skip
    for (method, layout, ckpt), figures in rows.items():
        world = 1 if layout == "one GPU" else 2
        est = lmcore.estimate_finetune_memory(config, method, 8, 1024, world, ckpt, lora_r=8, loss_logits="labelled")
        expected = (est.weights, est.gradients + est.optimizer_states, est.gathered, est.activations, est.total)
        assert figures[:5] == [f"{b / GIB:.2f}" for b in expected]
        assert figures[5] == ("yes" if est.total <= 0.9 * 24 * GIB else "no")
    # 8 rows of 1024 tokens: finetune's loss holds 2048 rows of logits (8192 x 151936 would be 7 GiB), QLoRA fits
    # one card as it is, LoRA with block checkpointing.
    assert rows[("lora", "one GPU", "off")][-1] == "no" and rows[("lora", "one GPU", "block")][-1] == "yes"
    assert rows[("qlora", "one GPU", "off")][-1] == "yes"


def test_world_and_gpu_memory_change_the_verdicts(tmp_path, capsys):
    directory = str(_model_dir(tmp_path))
    status, lines = _doctor(capsys, "--from", directory, "--world", "4", "--gpu-memory", "80", "--micro-batch", "1")
    rows = _rows(lines)
    assert status == 0 and {layout for _, layout, _ in rows} == {"one GPU", "FSDP x 4"}
    assert rows[("full", "one GPU", "off")][-1] == "yes"  # an 80 GiB card holds the 23 GiB of states
    status, lines = _doctor(capsys, "--from", directory, "--gpu-memory", "2", "--world", "1")
    assert status == 1 and "one GPU: fits: none; does not fit: full, lora, qlora" in lines


def test_config_json_written_by_transformers_alone_suffices(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers writes the config.json here")
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      tie_word_embeddings=True)  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path)  # transformers 5's layout (rope_parameters), and no weights
    reference = sum(p.numel() for p in transformers.Qwen2ForCausalLM(config).parameters())
    status, lines = _doctor(capsys, "--from", str(tmp_path))
    assert status == 0 and f"{reference:,} parameters" in lines[0]


BAD_INPUT = [
    ("empty directory", lambda d: d.mkdir(), ["config.json missing", "fix: pass the directory save_pretrained wrote"]),
    ("no directory", lambda d: None, ["no such directory", "expected a Hugging Face model directory"]),
    ("config.json not JSON", lambda d: (d.mkdir(), (d / "config.json").write_text("{'hidden_size': 1536")),
     ["config.json: not JSON", "fix: restore the file"]),
    ("unknown architecture", lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {**QWEN2_1_5B, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))),
     ["architectures=['GPT2LMHeadModel']: expected one of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"]),
    ("a field missing", lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {k: v for k, v in QWEN2_1_5B.items() if k != "hidden_size"}))), ["hidden_size missing", "fix: add them"]),
]  # fmt: skip


@pytest.mark.parametrize("make, words", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path, capsys, make, words):
    directory = tmp_path / "model"
    make(directory)
    status = main(["doctor", "--from", str(directory)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"lmtrain doctor: error: --from {directory}: ") and str(directory) in line
    assert all(w in line for w in words), line


@pytest.mark.parametrize("argv, words", [
    (["--preset", "1.3b"], "--preset with --from"),
    (["--data", "d"], "--data with --from"),
])  # fmt: skip
def test_flags_of_the_checks_with_from_are_one_line(tmp_path, capsys, argv, words):
    status = main(["doctor", "--from", str(_model_dir(tmp_path)), *argv])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.startswith(f"lmtrain doctor: error: {words}")


def test_seq_len_without_from_is_one_line(capsys):
    assert main(["doctor", "--seq-len", "512"]) == 2
    assert capsys.readouterr().err.strip() == ("lmtrain doctor: error: --seq-len is for the fine-tuning table: add "
                                               "--from DIR (a Hugging Face model directory)")  # fmt: skip
