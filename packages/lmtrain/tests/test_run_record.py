"""run.json is one typed record (lmtrain.run_record): written by every command that trains, read through one
function by the commands that read a run, files written before the record (format 0) included."""

import json
import shutil
from pathlib import Path

import pytest
from trained_runs import tiny_run

from lmtrain.errors import LmtrainError
from lmtrain.run_record import RunRecord, read_run_record

OLD = Path(__file__).parent / "data" / "run_json_v0"  # written by lmtrain before the record had a format


def test_run_json_files_of_the_earlier_format_read():
    train = RunRecord.from_json(json.loads((OLD / "train.json").read_text()), "train.json")
    finetune = RunRecord.from_json(json.loads((OLD / "finetune.json").read_text()), "finetune.json")
    assert (train.format, train.command, train.recipe, train.seq_len) == (0, "train", "tiny", 32)
    assert (finetune.format, finetune.command, finetune.finetune["lora"]["r"]) == (0, "finetune", 4)
    assert train.model().n_layer == 2 and train.train().max_steps == 4 and train.data_settings().seq_len == 32
    assert train.cpu_matmul is None and finetune.chat_template["name"] == "tokens"


def test_a_run_of_the_earlier_format_still_generates_evaluates_and_resumes(tmp_path_factory, tmp_path, capsys):
    from lmtrain.cli import main
    from lmtrain.sample import generate_text

    run, original = tmp_path / "run", tiny_run(tmp_path_factory)
    shutil.copytree(original, run)
    old = json.loads((OLD / "train.json").read_text())
    new = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**old, "model_config": new["model_config"],
                                              "tokenizer_sha256": new["tokenizer_sha256"]}))  # fmt: skip
    assert read_run_record(run).format == 0
    assert generate_text(str(run), "def", max_new_tokens=3, seed=0).startswith("def")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    assert main(["eval", "--run", str(run), "--text", str(text), "--json"]) == 0
    assert main(["train", "--data", str(original.parent / "data"), "--out", str(run), "--resume", "--max-steps", "5",
                 "--no-progress"]) == 0  # fmt: skip
    assert read_run_record(run).format == 0 and read_run_record(run).world_size == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_config": None}, "expected 'model_config' to be an object"),
        ({"data_config": {"seq_len": 0}}, "data_config.seq_len=0: expected a positive integer"),
        ({"eos_id": "2"}, "eos_id='2': expected an integer or null"),
        ({"cpu_matmul": "blas"}, "cpu_matmul='blas': expected one of mkl, onednn or null"),
        ({"world_size": 0}, "world_size=0: expected a positive integer"),
        ({"command": "dance"}, "command='dance': expected one of train, finetune"),
    ],
)
def test_a_bad_record_is_one_line(change, words):
    values = {**json.loads((OLD / "train.json").read_text()), **change}
    with pytest.raises(LmtrainError, match="run.json: " + words.replace("(", r"\(").replace(")", r"\)")):
        RunRecord.from_json(values, "run.json")
