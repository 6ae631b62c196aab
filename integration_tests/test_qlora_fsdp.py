"""QLoRA under trainloop's FSDP engine on 2 CPU gloo ranks against one process: the same losses and adapters, the
NF4 base weights really sharded (each rank holds its half of every layer's codes), both kinds of FSDP checkpoint
resumed (on 2 ranks and, sharded, on 1), the adapters rank 0 writes equal to the final checkpoint's, and a number of
ranks that cannot split the NF4 weights refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env, train_losses
from test_distributed import free_port, torchrun

pytest.importorskip("torchao")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_qlora_fsdp.py"
STEPS, SAVE = 6, 3
# Measured on this machine: the 2-rank losses differ from one process's by at most 1e-7 relative, the adapters by
# at most 3e-7 (float summation order of another number of ranks); the bounds leave room for other machines.
RTOL = 1e-5
ATOL = 1e-5


def _run(args: dict, nproc: int) -> dict[int, dict]:
    """{rank: its RANK report}."""
    script = [str(SCRIPT), json.dumps(args)]
    ranks = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd = [sys.executable, *script] if nproc == 1 else torchrun(*ranks, *script)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    reports = [json.loads(x[len("RANK ") :]) for x in result.stdout.splitlines() if x.startswith("RANK ")]
    assert len(reports) == nproc, result.stdout[-3000:]
    return {r["rank"]: r for r in reports}


def _worst(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def _weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def _resume_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step_{STEPS:08d}")  # as if the run had stopped after step SAVE
    (dst / "adapters.safetensors").unlink()
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (engine torch) and 2 FSDP ranks with sharded checkpoints: 6 steps, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("qlora_fsdp")
    one, two = root / "one", root / "two"
    reports = {"one": _run({"run_dir": str(one)}, 1), "two": _run({"run_dir": str(two), "engine": "fsdp"}, 2)}
    return {"one": one, "two": two, "reports": reports, "root": root}


def test_qlora_under_fsdp_equals_one_process(runs):
    one, two = runs["one"], runs["two"]
    worst = _worst(train_losses(two), train_losses(one))
    print(f"worst relative loss difference {worst:.2e}")
    assert worst <= RTOL, worst
    assert sorted(train_losses(two)) == list(range(1, STEPS + 1))
    assert train_losses(two)[STEPS] < train_losses(two)[1] - 0.05
    # The checkpoint reads back as LoRA: fp32 base weights (dequantized from NF4) under the plain layers' names ...
    got, want = _weights(two), _weights(one)
    assert sorted(got) == sorted(want) and "layers.0.self_attn.k_proj.weight" in got
    assert "layers.0.self_attn.q_proj.base.weight" in got and all(t.dtype == torch.float32 for t in got.values())
    # ... the same base as one process quantized (the NF4 format does not depend on the number of ranks), and
    # adapters trained alike.
    for name in want:
        if ".lora_" in name:
            torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(got[name], want[name]), name
    assert any(float(got[n].abs().sum()) > 0 for n in got if n.endswith("lora_B"))  # B starts at zero


def test_each_rank_holds_its_half_of_the_nf4_codes(runs):
    single, ranks = runs["reports"]["one"][0], runs["reports"]["two"]
    assert single["weight_types"] == ["NF4Tensor"] and len(single["codes"]) == 12  # 2 layers x (k, o, q, v, up, down)
    for rank, report in ranks.items():
        assert report["weight_types"] == ["DTensor"]
        for layer, (numel, digest) in report["codes"].items():
            assert numel * 2 == single["codes"][layer][0], layer
            assert digest == single["halves"][layer][rank], (layer, rank)  # rows [rank/2, (rank+1)/2) of the codes
        assert report["quantized_bytes"] < 0.6 * single["quantized_bytes"]


def test_the_adapters_rank_0_writes_are_the_final_checkpoints(runs):
    for run in (runs["one"], runs["two"]):
        adapters, final = load_file(str(run / "adapters.safetensors")), _weights(run)
        assert adapters and all(".lora_" in k for k in adapters)
        assert all(torch.equal(adapters[k], final[k]) for k in adapters)
        assert sorted(adapters) == sorted(k for k in final if ".lora_" in k)


def test_sharded_checkpoint_resumes_on_two_ranks_bit_exact_and_on_one(runs, tmp_path):
    two = runs["two"]
    again = _resume_copy(two, tmp_path / "again")
    _run({"run_dir": str(again), "engine": "fsdp", "resume": True}, 2)
    assert train_losses(again) == train_losses(two)
    assert all(torch.equal(a, _weights(two)[k]) for k, a in _weights(again).items())
    alone = _resume_copy(two, tmp_path / "alone")
    _run({"run_dir": str(alone), "engine": "fsdp", "resume": True}, 1)  # the shards re-split over one rank
    worst = _worst(train_losses(alone), train_losses(two))
    print(f"resumed on 1 rank: worst relative loss difference {worst:.2e}")
    assert worst <= RTOL, worst
    for name, tensor in _weights(alone).items():
        torch.testing.assert_close(tensor, _weights(two)[name], rtol=RTOL, atol=ATOL)


def test_full_state_checkpoint_saves_and_resumes(runs, tmp_path):
    full = tmp_path / "full"
    _run({"run_dir": str(full), "engine": "fsdp", "fsdp_checkpoint": "full"}, 2)
    files = set(json.loads((full / "checkpoints" / f"step_{SAVE:08d}" / "manifest.json").read_text())["files"])
    assert "optimizer.pt" in files and not any(f.startswith("dcp/") for f in files)
    worst = _worst(train_losses(full), train_losses(runs["one"]))
    assert worst <= RTOL, worst
    resumed = _resume_copy(full, tmp_path / "resumed")
    _run({"run_dir": str(resumed), "engine": "fsdp", "fsdp_checkpoint": "full", "resume": True}, 2)
    assert train_losses(resumed) == train_losses(full)
    assert all(torch.equal(a, _weights(full)[k]) for k, a in _weights(resumed).items())


@pytest.mark.parametrize(("world", "words"), [(3, "(64 rows)"), (16, "not divisible by 16")])
def test_ranks_that_cannot_split_the_nf4_weights_are_one_line(world, words):
    from lmcore import GPT, ModelConfig, apply_lora
    from lmcore.qlora import quantize_frozen_linears
    from trainloop import ConfigError
    from trainloop.engine_fsdp import check_even_shards

    model = quantize_frozen_linears(apply_lora(GPT(ModelConfig.from_preset("tiny")), targets=["q"], r=4))
    assert len(check_even_shards(model, 2)) == 12  # 2 layers x (q base, k, v, o, up, down)
    with pytest.raises(ConfigError) as exc:
        check_even_shards(model, world)
    text = str(exc.value)
    assert "\n" not in text and f"on {world} ranks" in text and words in text and "NF4Tensor" in text, text
    assert "2, 4 or 8" in text and "engine='torch'" in text
