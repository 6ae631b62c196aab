"""plot_metrics draws what metrics.jsonl holds, labelled with its units, and no line twice."""

import json

import pytest

pytest.importorskip("matplotlib")

import trainloop.plotting as plotting  # noqa: E402


def _figure(tmp_path, monkeypatch, records):
    figures = []
    new_figure = plotting.new_figure
    monkeypatch.setattr(plotting, "new_figure", lambda *a: figures.append(new_figure(*a)) or figures[-1])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plotting.plot_metrics(path, tmp_path / "m.png")
    return figures[0]


def test_one_parameter_group_draws_its_gradient_norm_once(tmp_path, monkeypatch):
    records = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 2.0 / s, "grad_norm/default": 2.0 / s}
               for s in range(1, 6)]  # fmt: skip
    loss, lr, norms = _figure(tmp_path, monkeypatch, records).axes
    assert [line.get_label() for line in norms.get_lines()] == ["total"]
    assert "nats per target token" in loss.get_ylabel() and norms.get_xlabel() == "optimizer step"


def test_two_groups_draw_the_total_and_each(tmp_path, monkeypatch):
    norms = {"grad_norm": 2.0, "grad_norm/decay": 1.6, "grad_norm/no_decay": 1.2}
    records = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, **norms} for s in range(1, 6)]
    norms = _figure(tmp_path, monkeypatch, records).axes[2]
    assert [line.get_label() for line in norms.get_lines()] == ["total", "decay", "no_decay"]
