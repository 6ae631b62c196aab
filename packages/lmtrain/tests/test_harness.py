"""`lmtrain eval --tasks` runs lm-evaluation-harness on the run's model, in process; its perplexity metrics map
onto `lmtrain eval --text`'s on the same text and windows."""

import inspect
import json
import math
import re
import sys

import pytest
import torch
from trained_runs import tiny_run

from lmtrain.cli import main

lm_eval = pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")

ROLLING_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """(task directory, text): one document of standard-library source, blank lines and indentation included."""
    root = tmp_path_factory.mktemp("tasks")
    text = inspect.getsource(json)[:4000]
    assert "\n\n" in text and "\n    " in text
    (root / "doc.txt").write_text(text, encoding="utf-8")
    (root / "docs.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    (root / "lmtrain_text.yaml").write_text(ROLLING_TASK.format(name="lmtrain_text", data=root / "docs.jsonl"))
    return root, text


def test_harness_metrics_map_onto_lmtrain_eval(run, local_task, tmp_path, capsys):
    tasks, text = local_task
    context = json.loads((run / "run.json").read_text())["data_config"]["seq_len"]
    out = tmp_path / "results"
    argv = ["eval", "--run", str(run), "--tasks", "lmtrain_text", "--include-path", str(tasks)]
    assert main([*argv, "--bootstrap-iters", "0", "--out", str(out)]) == 0
    assert "bits_per_byte" in capsys.readouterr().out  # the harness's table
    assert (out / "results.md").read_text().count("|") > 10
    theirs = json.loads((out / "results.json").read_text())["results"]["lmtrain_text"]
    # The harness scores disjoint windows of max_length tokens: lmtrain eval with --stride = --context.
    assert main(["eval", "--run", str(run), "--text", str(tasks / "doc.txt"), "--stride", str(context), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same summed NLL over the same bytes: equal up to float32 logits summed in another order.
    assert theirs["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-6)
    assert theirs["byte_perplexity,none"] == pytest.approx(2 ** ours["bits_per_byte"], rel=1e-6)
    # word perplexity: one NLL over two word counts. lmtrain adds one word per line end, the harness splits on
    # runs of whitespace (an empty last piece after the final newline counts as a word).
    harness_words = len(re.split(r"\s+", text))
    assert ours["words"] == len(text.split()) + text.count("\n") != harness_words
    nll = ours["loss"] * ours["tokens"]
    assert math.log(theirs["word_perplexity,none"]) == pytest.approx(nll / harness_words, rel=1e-6)
    assert math.log(ours["word_ppl"]) == pytest.approx(nll / ours["words"], rel=1e-9)


def test_harness_hf_model_on_the_export_gives_the_same_bits_per_byte(run, local_task, tmp_path, capsys):
    """lm-eval's own `hf` model on `export --format hf` (no custom code). Its tokenizer adds the document-start
    token and the harness's rolling windows put it in front again: add_bos_token=False keeps one, as ours."""
    from lm_eval.models.huggingface import HFLM

    from lmtrain.harness import task_manager

    tasks, _ = local_task
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    lm = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=4, add_bos_token=False)
    context = json.loads((run / "run.json").read_text())["data_config"]["seq_len"]
    assert lm.max_length == context and lm.prefix_token_id == json.loads((run / "run.json").read_text())["eos_id"]
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["lmtrain_text"], task_manager=task_manager(str(tasks)), bootstrap_iters=0, log_samples=False
    )["results"]["lmtrain_text"]
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--text", str(tasks / "doc.txt"), "--stride", str(context), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-6)


def test_loglikelihood_is_the_models_own(run):
    from lm_eval.api.instance import Instance

    from lmtrain.harness import run_lm
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.text_codec import encode

    model, _, _ = load_trained_model(run)
    sp = load_tokenizer(run)
    lm = run_lm(model, sp, eos_id=2, max_length=32, batch_size=2)
    pairs = [("def main(argv):", "\n    return 0\n"), ("import", " os"), ("x = 1", "\n"), ("", "class A:")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        whole = [2] + encode(sp, context + continuation)  # a document start, then the text
        n = len(whole) - 1 - len(encode(sp, context))
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)  # (T, V)
        target = torch.tensor(whole[-n:])
        expected = logits[-n:].gather(1, target[:, None]).sum()
        assert logprob == pytest.approx(float(expected), abs=1e-4)
        assert greedy == bool((logits[-n:].argmax(-1) == target).all())


def test_generate_until_is_lmtrain_generate_greedy_cut_at_the_stop(run):
    from lm_eval.api.instance import Instance

    from lmtrain.harness import run_lm
    from lmtrain.run_files import load_tokenizer, load_trained_model
    from lmtrain.sample import generate_text

    model, run_json, _ = load_trained_model(run)
    lm = run_lm(model, load_tokenizer(run), eos_id=run_json.eos_id, max_length=64)
    for i, prompt in enumerate(["def main(", "import "]):
        greedy = generate_text(str(run), prompt, max_new_tokens=12, temperature=0)[len(prompt) :]
        stop = greedy[3:5]  # a stop string the continuation holds: the harness's text ends before it
        request = Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), i)
        assert lm.generate_until([request]) == [greedy[: greedy.index(stop)]]
        unstopped = Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 12}), i)
        assert lm.generate_until([unstopped]) == [greedy]


@pytest.mark.parametrize(
    "case", ["unknown task", "harness missing", "out exists", "no include dir", "--json", "dataset unreachable"]
)
def test_bad_input_is_one_line_and_writes_nothing(run, local_task, tmp_path, capsys, monkeypatch, case):
    tasks, _ = local_task
    out = tmp_path / "results"
    argv = ["eval", "--run", str(run), "--tasks", "lmtrain_text", "--include-path", str(tasks), "--out", str(out)]
    if case == "unknown task":
        argv[4], named = "lmtrain_txet", "--tasks 'lmtrain_txet': not a task, group or tag"
    elif case == "harness missing":
        monkeypatch.setitem(sys.modules, "lm_eval", None)
        named = "needs lm-evaluation-harness, which is not installed: pip install"
    elif case == "out exists":
        out.mkdir()
        named = "exists; choose a new directory"
    elif case == "dataset unreachable":  # offline (the conftest sets HF_DATASETS_OFFLINE): not on the Hub, not cached
        (tmp_path / "tasks").mkdir()
        (tmp_path / "tasks" / "remote.yaml").write_text(
            ROLLING_TASK.format(name="lmtrain_remote", data="x.jsonl").replace(
                "dataset_path: json", "dataset_path: no-one/none"
            )
        )
        argv[4], argv[6] = "lmtrain_remote", str(tmp_path / "tasks")
        named = "a task's dataset could not be loaded"
    elif case == "--json":
        argv.append("--json")
        named = "--json applies to --text only"
    else:
        argv[6], named = str(tmp_path / "nowhere"), "not a directory of task YAML files"
    before = sorted(p.name for p in tmp_path.iterdir())
    runs_before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmtrain eval: error: ") and named in err[0], err
    if case == "unknown task":
        assert "did you mean lmtrain_text" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in run.iterdir()) == runs_before
