"""`lmtrain doctor --preset P --world N`: the table of configurations (GPU, host, pinned, NVMe bytes, network
traffic, whether each fits), the recommended one and its rule, and one line for each bad flag."""

from __future__ import annotations

import pytest

import lmcore
from lmcore.memory import ZeroSettings
from lmtrain.cli import main
from lmtrain.doctor_plan import LAYOUTS, format_plan, network_bytes, plan_layouts

GIB = 2**30


def _table(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(["doctor", *argv])
    return status, capsys.readouterr().out.splitlines()


def _rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """(configuration, checkpointing) -> the figures and the verdict, from the printed table."""
    names = sorted((layout.name for layout in LAYOUTS), key=len, reverse=True)
    out = {}
    for line in lines:
        name = next((n for n in names if line.startswith(n + " ")), None)
        if name is not None:
            ckpt, *rest = line[len(name) :].split()
            out[(name, ckpt)] = rest
    return out


def test_the_table_holds_every_configuration_with_lmcores_estimates(capsys):
    status, lines = _table(capsys, "--preset", "2.7b", "--world", "32", "--micro-batch", "2")
    assert status == 0
    assert lines[0].startswith("2.7b (2,599,572,480 parameters), 32 GPUs (4 per node), micro-batch 2 x 1024 tokens, "
                               "accumulation 16 (the recipe's), bf16, 24 GiB per GPU")  # fmt: skip
    rows = _rows(lines)
    assert {name for name, _ in rows} == {layout.name for layout in LAYOUTS} and len(rows) == 7
    cfg = lmcore.ModelConfig.from_preset("2.7b")
    kw = dict(world_size=32, gradient_accumulation_steps=16, activation_checkpointing="off")
    zero3 = lmcore.estimate_memory(cfg, 2, 1024, "bf16", zero_stage=3, **kw)
    nvme = lmcore.estimate_memory(cfg, 2, 1024, "bf16", zero_stage=3, offload_optimizer="cpu", offload_param="nvme",
                                  zero=ZeroSettings(max_in_cpu=0), **kw)  # fmt: skip
    fsdp = lmcore.estimate_fsdp_memory(cfg, 2, 1024, "bf16", cpu_offload=True, **kw)
    assert rows[("ZeRO-3", "off")][:4] == [f"{zero3.total / GIB:.2f}", f"{zero3.host_per_node(4) / GIB:.2f}", "0.00",
                                           "0.00"]  # fmt: skip
    assert rows[("ZeRO-3 + parameter offload nvme", "off")][:4] == [
        f"{b / GIB:.2f}" for b in (nvme.total, nvme.host_per_node(4), 4 * nvme.host_pinned, nvme.nvme_per_node(4))
    ]
    assert float(rows[("ZeRO-3 + parameter offload nvme", "off")][3]) > 0  # the partitions are on the drive
    assert rows[("FSDP + CPU offload", "off")][0] == f"{fsdp.total / GIB:.2f}"
    # Network bytes per GPU and step: ZeRO-2 < FSDP < ZeRO-3 with accumulation 16.
    net = {name: float(r[4]) for (name, _), r in rows.items()}
    assert net["ZeRO-2"] < net["FSDP"] < net["ZeRO-3"] == net["ZeRO-3 + parameter offload cpu"]
    assert all(r[5] == "yes" for r in rows.values())
    recommended = [line for line in lines if line.startswith("recommended: ")]
    assert recommended == [recommended[0]] and recommended[0].startswith("recommended: ZeRO-2 (")
    assert "rule: the fitting configuration that sends the fewest bytes over the network per step" in recommended[0]


def test_checkpointing_rows_appear_where_a_configuration_does_not_fit_without_it(capsys):
    status, lines = _table(capsys, "--preset", "2.7b", "--world", "32", "--micro-batch", "8")
    rows = _rows(lines)
    assert status == 0
    for layout in LAYOUTS:
        off = rows[(layout.name, "off")]
        assert ((layout.name, "block") in rows) == (off[5] == "no"), layout.name
    assert rows[("ZeRO-2", "off")][5] == "no" and rows[("ZeRO-2", "block")][5] == "yes"
    assert lines[-1].startswith("recommended: ZeRO-2 with --set checkpointing=block (")


def test_a_smaller_card_changes_what_fits_and_none_fitting_exits_1(capsys):
    cfg = lmcore.ModelConfig.from_preset("1.3b")
    zero2 = lmcore.estimate_memory(cfg, 2, 1024, "bf16", zero_stage=2, world_size=16, gradient_accumulation_steps=4)
    gpu = zero2.total / GIB / 0.9 - 0.01  # ZeRO-2 just misses the 90% line; its offload variant fits
    status, lines = _table(capsys, "--preset", "1.3b", "--world", "16", "--gpu-memory", f"{gpu:.3f}")
    rows = _rows(lines)
    assert status == 0 and rows[("ZeRO-2", "off")][5] == "no" and rows[("ZeRO-2", "block")][5] == "yes"
    assert rows[("ZeRO-2 + optimizer offload", "off")][5] == "yes"
    # Network first: ZeRO-2 with checkpointing sends less than any offload variant of ZeRO-3 or FSDP.
    assert lines[-1].startswith("recommended: ZeRO-2 with --set checkpointing=block")
    status, lines = _table(capsys, "--preset", "2.7b", "--world", "16", "--micro-batch", "64", "--gpu-memory", "8")
    assert status == 1 and lines[-1].startswith("recommended: none fits")


def test_the_ranking_rule_is_network_then_offload_then_checkpointing():
    rows, best, header = plan_layouts("1.3b", 16, 2, 24.0)
    assert best is not None and best.layout.name == "ZeRO-2"
    ranked = sorted(rows, key=lambda r: r.rank())
    assert [r.layout.name for r in ranked][:2] == ["ZeRO-2", "ZeRO-2 + optimizer offload"]
    text = format_plan(rows, best, header, 24.0)
    assert text.splitlines()[-1].startswith("recommended: ZeRO-2 ")


def test_network_bytes_per_step():
    zero2, zero3, fsdp = (next(x for x in LAYOUTS if x.name == n) for n in ("ZeRO-2", "ZeRO-3", "FSDP"))
    psi, world, accum = 10**9, 32, 16
    ring = (world - 1) / world
    assert network_bytes(zero2, psi, world, accum) == int((accum + 1) * 2 * psi * ring)
    assert network_bytes(zero3, psi, world, accum) == int(accum * 3 * 2 * psi * ring)
    assert network_bytes(fsdp, psi, world, accum) == int((accum * 2 * 2 * psi + 4 * psi) * ring)


BAD_FLAGS = [
    (["--preset", "1.3b", "--world", "0"], "argument --world: expected a whole number >= 1, got '0'"),
    (["--preset", "1.3b", "--world", "-16"], "argument --world: expected a whole number >= 1, got '-16'"),
    (["--preset", "1.3b", "--world", "16x"], "argument --world: expected a whole number >= 1, got '16x'"),
    (["--preset", "1.3b", "--world", "16", "--micro-batch", "0"], "argument --micro-batch: expected a whole number"),
    (
        ["--preset", "1.3b", "--world", "16", "--gpu-memory", "0"],
        "argument --gpu-memory: expected a finite number of GiB > 0, got '0'",
    ),  # fmt: skip
    (["--preset", "1.3b", "--world", "16", "--gpu-memory", "nan"], "argument --gpu-memory: expected a finite number"),
    (["--preset", "1.3b", "--world", "16", "--gpu-memory", "inf"], "argument --gpu-memory: expected a finite number"),
    (["--preset", "1.3b", "--world", "16", "--gpu-memory", "24GB"], "got '24GB'"),
    (["--world", "16"], "--world needs --preset: lmtrain doctor --preset 1.3b --world 16 --micro-batch 2"),
    (["--preset", "13b", "--world", "16"], "--preset '13b' is unknown; known presets: "),
    (["--preset", "1.3b", "--world", "16", "--gpus-per-node", "3"], "--gpus-per-node 3 must divide --world 16"),
    (["--preset", "1.3b", "--micro-batch", "2"], "--micro-batch is for the configuration table: add --world N"),
    (["--preset", "1.3b", "--world", "16", "--data", "d"], "--world prints the configuration table only"),
]


@pytest.mark.parametrize("argv, words", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, words):
    try:
        status = main(["doctor", *argv])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("lmtrain doctor: error: ") and words in line, line
    assert len([x for x in err.splitlines() if x.startswith("lmtrain doctor: error")]) == 1
