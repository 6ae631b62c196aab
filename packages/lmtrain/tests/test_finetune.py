"""`lmtrain finetune`: label masks, the chat template against transformers' apply_chat_template, packed samples that
do not attend to each other, LoRA that leaves the base weights alone, exact resume, and every bad input."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file
from trained_runs import tiny_run

from lmcore import GPT, ModelConfig
from lmtrain.chat import (
    IGNORE_INDEX,
    PLAIN_TEMPLATE,
    encode_samples,
    encode_turns,
    pack_rows,
    pad_batch,
    read_samples,
    split_samples,
    template_for,
)
from lmtrain.cli import main
from lmtrain.finetune_run import finetune

FT = ["--seq-len", "128", "--lora-r", "4", "--set", "micro_batch=2", "--max-steps", "1"]


def _pairs(path, n=40):
    rows = [{"prompt": f"def f{i}(x):\n    'Twice x.'\n", "response": f"    return {i} * x\n", "group": f"m{i % 7}"}
            for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    run = tiny_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("ft")
    return {"run": run, "sp": spm.SentencePieceProcessor(model_file=str(run / "tokenizer.model")),
            "pairs": _pairs(root / "pairs.jsonl")}  # fmt: skip


def _pieces(sp, ids):
    return [sp.id_to_piece(i) if i >= 0 else i for i in ids]


def test_labels_single_turn(made):
    sp = made["sp"]
    ids, labels = encode_turns(sp, template_for(sp), [("system", "s"), ("user", "q"), ("assistant", "a")])
    assert _pieces(sp, ids) == ["<|system|>", "s", "<|end|>", "<|user|>", "q", "<|end|>", "<|assistant|>", "a",
                                "<|end|>", "</s>"]  # fmt: skip
    assert _pieces(sp, labels) == [IGNORE_INDEX] * 7 + ["a", "<|end|>", "</s>"]


def test_labels_multi_turn(made):
    sp = made["sp"]
    turns = [("user", "q"), ("assistant", "a"), ("user", "r"), ("assistant", "b")]
    ids, labels = encode_turns(sp, template_for(sp), turns)
    # <|user|> q <|end|> <|assistant|> a <|end|> <|user|> r <|end|> <|assistant|> b <|end|> </s>
    target = [i for i, v in enumerate(labels) if v != IGNORE_INDEX]
    assert target == [4, 5, 10, 11, 12]
    assert [labels[i] for i in target] == [ids[i] for i in target]


def test_truncation_keeps_the_start_and_counts(made, tmp_path):
    sp = made["sp"]
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "q", "response": "a" * 200}) + "\n"
                    + json.dumps({"prompt": "q" * 200, "response": "a"}) + "\n")  # fmt: skip
    samples = read_samples(long)
    kept = encode_samples(sp, template_for(sp), samples, seq_len=16)
    assert (kept.truncated, kept.skipped, len(kept.samples)) == (1, 1, 1)  # the second has no label left
    ids, labels = kept.samples[0]
    full_ids, full_labels = encode_turns(sp, template_for(sp), samples[0].turns)
    assert ids == full_ids[:17] and labels == full_labels[:17]
    skipped = encode_samples(sp, template_for(sp), samples, seq_len=16, too_long="skip")
    assert (skipped.truncated, skipped.skipped, len(skipped.samples)) == (0, 2, 0)


def test_plain_template_for_a_tokenizer_without_chat_tokens(tmp_path):
    import tokbin
    from lmtrain.corpus import build_corpus
    from lmtrain.text_codec import LOSSLESS_SPM_OPTIONS

    build_corpus(tmp_path / "c.txt", 60_000)
    text = (tmp_path / "c.txt").read_text(encoding="utf-8")
    (tmp_path / "c.txt").write_text("".join(c for c in text if c.isascii()), encoding="utf-8")
    model = tokbin.train_tokenizer([tmp_path / "c.txt"], tmp_path / "old", 400, **LOSSLESS_SPM_OPTIONS)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert template_for(sp) is PLAIN_TEMPLATE
    ids, labels = encode_turns(sp, PLAIN_TEMPLATE, [("user", "q"), ("assistant", "a")])
    assert sp.decode(ids[:-1]) == "User:\nq\n\nAssistant:\na\n\n"
    assert sp.decode([v for v in labels[:-1] if v != IGNORE_INDEX]) == "a\n\n"


def test_held_out_split_by_group(made):
    train, val = split_samples(read_samples(made["pairs"]), 0.3)
    assert train and val and not {s.group for s in train} & {s.group for s in val}


def test_template_ids_equal_apply_chat_template(made, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from lmtrain.export import export_run

    ft = tmp_path / "ft"
    finetune(f"{made['run']}:latest", made["pairs"], ft, max_steps=1, lora_r=4, seq_len=128,
             overrides={"micro_batch": 2}, quiet=True)  # fmt: skip
    export_run(ft, tmp_path / "hf", fmt="hf", merge_lora=True)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = made["sp"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):\n    'Twice.'\n"},
        {"role": "assistant", "content": "    return 2 * x\n"},
        {"role": "user", "content": "again"},
    ]
    turns = [(m["role"], m["content"]) for m in messages]
    ours, _ = encode_turns(sp, template_for(sp), turns, eos=False)
    theirs = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert list(theirs) == ours
    prompt = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(prompt) == ours + [sp.piece_to_id("<|assistant|>")]


def test_packed_samples_do_not_attend_to_each_other(made):
    sp = made["sp"]
    eos = sp.eos_id()
    a = encode_turns(sp, template_for(sp), [("user", "first"), ("assistant", "one")])
    b = encode_turns(sp, template_for(sp), [("user", "second"), ("assistant", "two")])
    (row,) = pack_rows([a, b], len(a[0]) + len(b[0]) + 2, eos)
    inputs, targets = pad_batch([row], eos)
    torch.manual_seed(0)
    for separator, leaks in ((eos, False), (None, True)):  # without the separator, B sees A: the test can fail
        model = GPT(ModelConfig.from_preset("tiny", vocab_size=400, document_separator=separator))
        embedded: dict[str, torch.Tensor] = {}

        def keep(module, args, out, embedded=embedded):
            out.retain_grad()
            embedded["x"] = out

        handle = model.embed_tokens.register_forward_hook(keep)
        logits = model(inputs).logits
        handle.remove()
        b_positions = torch.arange(len(a[0]), len(a[0]) + len(b[0]) - 1)  # B's tokens predicting B's tokens
        loss = torch.nn.functional.cross_entropy(logits[0, b_positions], targets[0, b_positions])
        loss.backward()
        grad_a = embedded["x"].grad[0, : len(a[0])]
        assert (grad_a.abs().max().item() > 0) == leaks
        assert embedded["x"].grad[0, len(a[0])].abs().max() > 0


def test_lora_leaves_the_base_weights_bit_identical(made, tmp_path):
    ft = tmp_path / "ft"
    finetune(f"{made['run']}:latest", made["pairs"], ft, max_steps=2, lora_r=4, seq_len=128,
             overrides={"micro_batch": 2, "lr": 1e-2}, quiet=True)  # fmt: skip
    source = load_file(str(made["run"] / "checkpoints" / "step_00000004" / "model.safetensors"))
    tuned = load_file(str(ft / "checkpoints" / "step_00000002" / "model.safetensors"))
    adapted = {k.replace(".base.", "."): v for k, v in tuned.items() if "lora_" not in k}
    assert set(adapted) == set(source)
    assert all(torch.equal(adapted[k], source[k]) for k in source)
    moved = [k for k, v in tuned.items() if k.endswith("lora_B") and v.abs().max() > 0]
    assert moved  # the adapters did train


def test_resumed_finetune_gives_the_same_losses(made, tmp_path):
    settings = dict(max_steps=4, lora_r=4, seq_len=128, lora_dropout=0.1, quiet=True,
                    overrides={"micro_batch": 2, "save_every": 2, "eval_every": 2, "log_every": 1})  # fmt: skip
    straight = tmp_path / "straight"
    finetune(f"{made['run']}:latest", made["pairs"], straight, **settings)
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight, interrupted)
    # As if killed after the checkpoint at step 2: the later checkpoint and records are gone.
    shutil.rmtree(interrupted / "checkpoints" / "step_00000004")
    best = interrupted / "checkpoints" / "best.json"
    best.write_text(json.dumps(json.loads(best.read_text()) | {"checkpoint": "step_00000002", "step": 2}))
    finetune(f"{made['run']}:latest", made["pairs"], interrupted, resume=True, **settings)

    def losses(run):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r and "lr" in r}

    first, second = losses(straight), losses(interrupted)
    assert first[3] == second[3] and first[4] == second[4]


def test_full_method_trains_every_weight(made, tmp_path, capsys):
    args = ["--from", f"{made['run']}:latest", "--data", str(made["pairs"]), "--out", str(tmp_path / "ft")]
    code = main(["finetune", *args, "--method", "full", *FT])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if "trainable parameters" in x)
    count, total = (int(v.replace(",", "")) for v in line.split(": ")[-1].split(" (")[0].split(" of "))
    assert count == total


def _bad(tmp, made, text):
    path = tmp / "bad.jsonl"
    path.write_text(text)
    return path


BAD_LINES = [
    ('{"messages": {"role": "user"}}\n', "messages: expected a list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}\n', "role: expected one of system, user, assistant"),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', "expected at least one assistant turn"),
    ('{"prompt": "x", "response": "  "}\n', "found an empty one"),
    ("not json\n", "found text that is not JSON"),
]


@pytest.mark.parametrize(("text", "words"), BAD_LINES)
def test_bad_samples_are_one_line(made, tmp_path, capsys, text, words):
    data = _bad(tmp_path, made, '{"prompt": "a", "response": "b"}\n' + text)
    out = tmp_path / "out"
    code = main(["finetune", "--from", f"{made['run']}:latest", "--data", str(data), "--out", str(out), *FT])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err and "line 2" in err, err
    assert not out.exists()


def _no_checkpoints(tmp, made):
    empty = tmp / "empty"
    empty.mkdir()
    for name in ("run.json", "tokenizer.model"):
        shutil.copy(made["run"] / name, empty / name)
    return [f"{empty}:latest"], "no complete checkpoint"


def _other_tokenizer(tmp, made):
    other = tmp / "other"
    shutil.copytree(made["run"], other)
    recorded = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps(recorded | {"tokenizer_sha256": "0" * 64}))
    return [f"{other}:latest"], "tokenizer sha256 0000"


@pytest.mark.parametrize(
    ("setup", "flags", "words"),
    [
        (_no_checkpoints, [], "no complete checkpoint"),
        (_other_tokenizer, [], "tokenizer sha256"),
        (None, ["--lora-targets", "gate"], "no linear layer named ['gate_proj']"),
        (None, ["--lora-r", "0"], "--lora-r 0: expected a positive integer"),
        (None, ["--lora-targets", "qq"], "unknown LoRA target 'qq'"),
        (None, ["--val-fraction", "1.5"], "--val-fraction 1.5: expected a fraction in (0, 1)"),
        (None, ["--method", "qlora", "--engine", "deepspeed"], "--method qlora with --engine deepspeed"),
    ],
)
def test_bad_sources_and_settings_are_one_line(made, tmp_path, capsys, setup, flags, words):
    source = [f"{made['run']}:latest"] if setup is None else setup(tmp_path, made)[0]
    out = tmp_path / "out"
    code = main(["finetune", "--from", *source, "--data", str(made["pairs"]), "--out", str(out), *FT, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not out.exists()


def test_qlora_without_its_extra_is_one_line(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    for name in [m for m in sys.modules if m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "out"
    code = main(["finetune", "--from", f"{made['run']}:latest", "--data", str(made["pairs"]), "--out", str(out),
                 "--method", "qlora", *FT])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "[qlora]" in err, err
    assert not out.exists()


def test_prompts_without_references_are_one_line(made, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "reference": "    return x"}\n{"prompt": "def g(x):"}\n')
    out = tmp_path / "gen.jsonl"
    code = main(["eval", "--run", str(made["run"]), "--prompts", str(prompts), "--generations", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "line 2: expected a reference answer" in err, err
    assert not out.exists()


def test_eval_prompts_scores_and_writes_every_generation(made, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")
    prompts = tmp_path / "prompts.jsonl"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    prompts.write_text('{"prompt": "def f(x):", "reference": "    return x"}\n' + json.dumps(chat) + "\n")
    out = tmp_path / "gen.jsonl"
    assert main(["eval", "--run", str(made["run"]), "--prompts", str(prompts), "--generations", str(out),
                 "--max-new-tokens", "8", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["count"] == 2 and 0 <= result["bleu4"] <= 100 and 0 <= result["rougeL_f1"] <= 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reference"] for r in rows] == ["    return x", "a"] and all("generation" in r for r in rows)


def test_qlora_finetune_reads_back_as_lora(made, tmp_path):
    pytest.importorskip("torchao")
    from lmcore.lora import lora_modules
    from lmtrain.run_files import load_trained_model

    ft = tmp_path / "ft"
    summary = finetune(f"{made['run']}:latest", made["pairs"], ft, method="qlora", max_steps=2, lora_r=4, seq_len=128,
                       overrides={"micro_batch": 2}, quiet=True)  # fmt: skip
    assert summary.step == 2
    model, run, _ = load_trained_model(ft, checkpoint="latest")
    assert run.finetune["method"] == "qlora" and len(lora_modules(model)) == 8
    source = load_file(str(made["run"] / "checkpoints" / "step_00000004" / "model.safetensors"))
    base = model.layers[0].self_attn.q_proj.base.weight
    original = source["layers.0.self_attn.q_proj.weight"]
    err = (base - original).abs().max().item()
    assert 0 < err <= 0.16 * original.abs().max().item()  # quantized, within NF4's widest half gap of the scale


def test_gradient_checkpointing_gives_the_same_losses(made, tmp_path):
    losses = {}
    for flag in (False, True):
        ft = tmp_path / f"ft-{flag}"
        finetune(f"{made['run']}:latest", made["pairs"], ft, max_steps=3, lora_r=4, seq_len=128, quiet=True,
                 gradient_checkpointing=flag, overrides={"micro_batch": 2, "log_every": 1, "lr": 1e-2})  # fmt: skip
        records = [json.loads(line) for line in (ft / "metrics.jsonl").read_text().splitlines()]
        losses[flag] = [r["loss"] for r in records if "lr" in r]
        checkpointing = json.loads((ft / "run.json").read_text())["model_config"]["checkpointing"]
        assert checkpointing == ("block" if flag else "off")
    assert len(losses[True]) == 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_gzip_and_plain_read_alike(made, tmp_path):
    import gzip

    packed = tmp_path / "pairs.jsonl.gz"
    packed.write_bytes(gzip.compress(made["pairs"].read_bytes()))
    assert read_samples(packed) == read_samples(made["pairs"])


def test_the_batches_resume_at_the_same_row_on_another_number_of_ranks():
    from lmtrain.chat import ChatBatches

    samples = [([i, i + 1, i + 2], [i, i + 1, i + 2]) for i in range(64)]
    two = [ChatBatches(samples, 8, 4, 0, batching="pad", rank=r, world_size=2) for r in range(2)]
    for batches in two:
        it = iter(batches)
        for _ in range(3):  # 3 global batches of 8 rows
            next(it)
    one = ChatBatches(samples, 8, 4, 0, batching="pad")
    one.load_state_dict(two[0].state_dict())
    whole = ChatBatches(samples, 8, 4, 0, batching="pad")
    it = iter(whole)
    for _ in range(6):  # the same 24 rows on one rank
        next(it)
    assert torch.equal(next(iter(one))[0], next(it)[0])
