"""`lmtrain finetune --from DIR` on a Hugging Face base model (a tiny random Qwen2 written by transformers here): its
own tokenizer and chat template (the ids apply_chat_template gives), LoRA, QLoRA and full fine-tuning with
--trainable, exact resume, and the export back as the same architecture (merged, and as a PEFT adapter that peft
loads onto the original base directory); every bad base is one line and writes nothing."""

import json
import shutil

import pytest
import torch
from hf_base import write_qwen2_base

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmtrain.cli import main  # noqa: E402
from lmtrain.run_record import read_run_record  # noqa: E402

SMALL = ["--seq-len", "96", "--set", "micro_batch=4", "--set", "cpu_threads=1", "--set", "eval_every=0",
         "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    base = write_qwen2_base(root / "qwen")
    rows = []
    for i in range(48):
        messages = [{"role": "user", "content": f"What is {i} times two?"},
                    {"role": "assistant", "content": f"It is {2 * i}."}]  # fmt: skip
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        rows.append({"messages": messages, "group": f"g{i}"})
    pairs = root / "chat.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"base": base, "pairs": pairs, "rows": rows}


def _finetune(made, out, *flags):
    return main(["finetune", "--from", str(made["base"]), "--data", str(made["pairs"]), "--out", str(out), *SMALL,
                 *flags])  # fmt: skip


def test_a_bases_samples_are_its_own_templates_ids_labelled_on_the_replies(made):
    from transformers import AutoTokenizer

    from lmtrain.base_model import chat_encoder, read_base

    base = read_base(str(made["base"]))
    encode, hf = chat_encoder(base.tokenizer, "base"), AutoTokenizer.from_pretrained(made["base"])
    for row in made["rows"][:6]:
        turns = [(m["role"], m["content"]) for m in row["messages"]]
        ids, labels = encode(turns)
        assert ids == hf.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        labelled = hf.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
        assert labelled == row["messages"][-1]["content"] + "<|im_end|>"


def test_lora_on_a_base_exports_back_as_its_architecture_and_as_a_peft_adapter_for_the_original(made, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcore import merge_lora
    from lmcore.hf_llama import hf_name
    from lmtrain.run_files import load_trained_model

    run = tmp_path / "ft"
    assert _finetune(made, run, "--max-steps", "3", "--set", "lr=1e-2") == 0
    record = read_run_record(run)
    assert record.base["architecture"] == "Qwen2ForCausalLM" and record.finetune["lora"]["r"] == 8
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in run.iterdir()}
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "peft")]) == 0
    model, _, _ = load_trained_model(run)
    merge_lora(model)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    theirs = merged.state_dict()
    ours = {hf_name(k): v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    assert set(ours) == {k for k in theirs if k != "lm_head.weight"}
    for name, tensor in ours.items():  # every tensor, by name, shape and value
        assert theirs[name].shape == tensor.shape and torch.equal(theirs[name], tensor), name
    original = AutoModelForCausalLM.from_pretrained(made["base"]).eval()
    peft = PeftModel.from_pretrained(original, tmp_path / "peft" / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
        torch.testing.assert_close(merged(ids).logits, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(peft(ids).logits, ref, atol=1e-5, rtol=1e-5)
    trained = AutoTokenizer.from_pretrained(tmp_path / "merged")
    messages = made["rows"][0]["messages"]
    assert trained.apply_chat_template(messages, tokenize=False) == AutoTokenizer.from_pretrained(
        made["base"]
    ).apply_chat_template(messages, tokenize=False)


def test_generate_and_eval_read_a_base_finetune_alone(made, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")
    from lmtrain.sample import generate_text

    run = tmp_path / "ft"
    assert _finetune(made, run, "--max-steps", "2") == 0
    shutil.move(made["base"], tmp_path / "moved")  # the run holds what it needs: tokenizer files and weights
    try:
        reply = generate_text(str(run), "What is 3 times two?", chat=True, max_new_tokens=8, temperature=0)
        again = generate_text(str(run), "What is 3 times two?", chat=True, max_new_tokens=8, temperature=0)
        assert reply == again and "<|im_start|>" not in reply
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in made["rows"][:3]))
        capsys.readouterr()
        assert main(["eval", "--run", str(run), "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["count"] == 3
        text = tmp_path / "text.txt"
        text.write_text("It is 6. It is 8.\n" * 20)
        assert main(["eval", "--run", str(run), "--text", str(text), "--json", "--context", "32"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["lossless_encoding"] and result["tokens"] > 0
    finally:
        shutil.move(tmp_path / "moved", made["base"])


def test_full_fine_tuning_with_trainable_moves_only_what_it_names(made, tmp_path):
    from lmcore import from_hf
    from lmtrain.run_files import load_trained_model

    run = tmp_path / "mlp"
    assert _finetune(made, run, "--method", "full", "--trainable", "mlp", "--max-steps", "2", "--set", "lr=1e-2") == 0
    trained = load_trained_model(run)[0].state_dict()
    before = from_hf(made["base"]).state_dict()
    moved = {name for name, tensor in trained.items() if not torch.equal(tensor, before[name])}
    assert moved and all(".mlp." in name for name in moved), sorted(moved)
    assert read_run_record(run).finetune["trainable"] == "mlp"


def test_a_bf16_base_trains_in_fp32_so_small_steps_are_kept(made, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lmcore import from_hf
    from lmtrain.run_files import load_trained_model

    base = tmp_path / "bf16"
    shutil.copytree(made["base"], base)
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(base)  # as published bases are
    flags = ("--data", str(made["pairs"]), *SMALL, "--max-steps", "2")
    assert main(["finetune", "--from", str(base), "--out", str(tmp_path / "full"), "--method", "full", *flags]) == 0
    trained, before = load_trained_model(tmp_path / "full")[0].state_dict(), from_hf(base).state_dict()
    q = "layers.0.self_attn.q_proj.weight"
    assert before[q].dtype == torch.bfloat16 and trained[q].dtype == torch.float32
    # lr 5e-5 (full fine-tuning's default): in bf16 most entries would round back to where they were
    assert (trained[q] != before[q].float()).float().mean() > 0.9
    assert main(["finetune", "--from", str(base), "--out", str(tmp_path / "lora"), *flags]) == 0
    with safe_open(str(tmp_path / "lora" / "adapters.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}  # noqa: SIM118 (not a Mapping)
    model = load_trained_model(tmp_path / "lora")[0]
    assert model.layers[0].self_attn.q_proj.base.weight.dtype == torch.bfloat16  # the frozen base stays in 16 bits


def test_qlora_on_a_base_trains_only_the_adapters(made, tmp_path):
    pytest.importorskip("torchao")
    from lmcore import from_hf
    from lmtrain.run_files import load_trained_model

    run = tmp_path / "q"
    assert _finetune(made, run, "--method", "qlora", "--max-steps", "2", "--set", "lr=1e-2") == 0
    model = load_trained_model(run)[0]
    base = from_hf(made["base"]).state_dict()
    adapters = {n: t for n, t in model.state_dict().items() if "lora_" in n}
    assert adapters and any(t.abs().sum() > 0 for n, t in adapters.items() if "lora_B" in n)  # B moved from zero
    # The base weights are the 4-bit NormalFloat round trip of the original, not trained further.
    for name, tensor in model.state_dict().items():
        if ".base." in name:
            original = base[name.replace(".base.", ".")]
            assert (tensor - original).abs().max() <= 0.5 * original.abs().max() + 1e-6, name


def test_a_resumed_base_finetune_gives_the_same_losses(made, tmp_path):
    def losses(run):
        return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert _finetune(made, tmp_path / "once", "--max-steps", "4", "--set", "log_every=1") == 0
    assert _finetune(made, tmp_path / "twice", "--max-steps", "4", "--set", "log_every=1", "--set", "save_every=2") == 0
    shutil.rmtree(tmp_path / "twice" / "checkpoints" / "step_00000004")
    steps = [r for r in map(json.loads, (tmp_path / "twice" / "metrics.jsonl").read_text().splitlines())]
    (tmp_path / "twice" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in steps if r.get("step", 0) <= 2)
    )
    assert _finetune(made, tmp_path / "twice", "--max-steps", "4", "--set", "log_every=1", "--resume") == 0
    assert losses(tmp_path / "twice") == losses(tmp_path / "once")


def test_gguf_export_of_a_base_finetune_holds_every_merged_tensor_under_llama_cpps_names(made, tmp_path):
    gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")
    import numpy as np
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert _finetune(made, run, "--max-steps", "2", "--set", "lr=1e-2") == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--merge-lora"]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m.gguf"), "--format", "gguf",
                 "--merge-lora", "--outtype", "f32"]) == 0  # fmt: skip
    # Hugging Face names -> llama.cpp's (Qwen2 keeps transformers' rotary layout: no q/k permutation)
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    want = {}
    for name, tensor in load_file(str(tmp_path / "hf" / "model.safetensors")).items():
        if name == "lm_head.weight":
            continue  # tied: the embedding is the output projection
        if name in top:
            want[top[name]] = tensor.float().numpy()
            continue
        _, _, index, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        want[f"blk.{index}.{layer[module]}.{kind}"] = tensor.float().numpy()
    got = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert [int(x) for x in tensor.shape] == list(reversed(want[name].shape)), name  # GGUF: fastest dim first
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(want[name].shape), want[name], err_msg=name)


def test_a_base_runs_tokenizer_that_is_not_the_weights_is_refused(made, tmp_path, capsys):
    run = tmp_path / "run"
    assert _finetune(made, run, "--max-steps", "1") == 0
    tokenizer = run / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")  # another file, the same tokenizer to any reader
    for argv in (["generate", "--run", str(run), "--chat", "--prompt", "hi"], ["export", "--run", str(run), "--out",
                 str(tmp_path / "hf")]):  # fmt: skip
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is not the tokenizer" in err and "tokenizer.json" in err, err
    assert not (tmp_path / "hf").exists()


def test_max_steps_on_resume_moves_the_end_as_train_does(made, tmp_path):
    run = tmp_path / "run"
    assert _finetune(made, run, "--max-steps", "2", "--set", "log_every=1") == 0
    assert _finetune(made, run, "--max-steps", "4", "--set", "log_every=1", "--resume") == 0
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4] and read_run_record(run).train().max_steps == 4


def _no_tokenizer(base, tmp):
    (tmp / "b" / "tokenizer.json").unlink()


def _broken_tokenizer(base, tmp):
    (tmp / "b" / "tokenizer.json").write_text("{not json")


def _no_template(base, tmp):
    (tmp / "b" / "chat_template.jinja").unlink()
    config = json.loads((tmp / "b" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp / "b" / "tokenizer_config.json").write_text(json.dumps(config))


def _pickled_weights(base, tmp):
    (tmp / "b" / "model.safetensors").rename(tmp / "b" / "pytorch_model.bin")


def _other_architecture(base, tmp):
    config = json.loads((tmp / "b" / "config.json").read_text())
    (tmp / "b" / "config.json").write_text(json.dumps(config | {"architectures": ["GPTNeoXForCausalLM"]}))


def _template_escape(base, tmp):
    (tmp / "b" / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")


@pytest.mark.parametrize(
    ("spoil", "flags", "words"),
    [
        (_no_tokenizer, [], "no tokenizer.json"),
        (_broken_tokenizer, [], "tokenizer.json"),
        (_no_template, [], "has no chat_template"),
        (_pickled_weights, [], "pytorch_model.bin"),
        (_other_architecture, [], "GPTNeoXForCausalLM"),
        (_template_escape, [], "chat_template"),
        (None, ["--batching", "pack"], "--batching pad"),
        (None, ["--method", "full", "--trainable", "nothing.*"], "--trainable nothing.*: matches no parameter"),
        (None, ["--trainable", "mlp"], "--trainable mlp: chooses what --method full trains"),
    ],
)
def test_a_bad_base_is_one_line_and_writes_nothing(made, tmp_path, capsys, spoil, flags, words):
    base = made["base"]
    if spoil is not None:
        shutil.copytree(made["base"], tmp_path / "b")
        spoil(made["base"], tmp_path)
        base = tmp_path / "b"
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["finetune", "--from", str(base), "--data", str(made["pairs"]), "--out", str(out), *SMALL,
                 "--max-steps", "1", *flags])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
    assert not out.exists()


def test_other_libraries_notices_a_user_cannot_act_on_stay_quiet(made, tmp_path):
    pytest.importorskip("torchao")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    argv = [sys.executable, "-m", "lmtrain", "finetune", "--from", str(made["base"]), "--data", str(made["pairs"]),
            "--out", str(tmp_path / "q"), "--method", "qlora", "--max-steps", "1", *SMALL]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    export = subprocess.run([sys.executable, "-m", "lmtrain", "export", "--run", str(tmp_path / "q"), "--out",
                             str(tmp_path / "hf")], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    said = done.stderr + export.stderr
    for noise in ("Failed to load", "Setting accelerator to CPU", "FutureWarning"):
        assert noise not in said, said[-2000:]
