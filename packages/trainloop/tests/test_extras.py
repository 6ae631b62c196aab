"""Extras: each missing one is one line naming it; TensorBoard for real (event file read back); DeepSpeed's range."""

import importlib.metadata
import json
import shutil
import subprocess
import sys

import pytest
import torch
from packaging.requirements import Requirement
from tiny_model import SeqData, TinyLM

from trainloop import TrainConfig, Trainer, plot_metrics
from trainloop.clipping import ClipGroups
from trainloop.engine_deepspeed import DeepSpeedEngine
from trainloop.extras import MissingExtraError, install_hint
from trainloop.gradient_inspector import inspect_gradients
from trainloop.metrics_logging import MetricsLogger

DIST = "lmtools-trainloop"


def _cfg(**kw):
    base = dict(lr=1e-2, min_lr=1e-4, max_steps=4, micro_batch=4, log_every=1, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def _metrics(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0}) + "\n"
                            for s in steps))  # fmt: skip
    return path


def _hide(monkeypatch, package):
    """Make ``package`` look uninstalled, submodules that earlier tests imported included."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")] or [package]:
        monkeypatch.setitem(sys.modules, name, None)


def _one_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("where", ["trainer", "engine"])
def test_deepspeed_missing_is_one_line_naming_the_extra(where, monkeypatch, tmp_path):
    _hide(monkeypatch, "deepspeed")
    cfg = _cfg(engine="deepspeed")
    with pytest.raises(MissingExtraError) as err:
        if where == "trainer":
            Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path)
        else:
            DeepSpeedEngine(TinyLM(), cfg, torch.device("cpu"), None, 1)
    assert _one_line(str(err.value)) == (
        f"TrainConfig.engine='deepspeed' needs deepspeed, which is not installed: {install_hint('deepspeed')}"
    )


def test_plot_without_matplotlib_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtraError) as err:
        plot_metrics(metrics, tmp_path / "m.png")
    assert _one_line(str(err.value)).endswith(f"needs matplotlib, which is not installed: {install_hint('plot')}")
    assert not (tmp_path / "m.png").exists()


def test_inspector_without_matplotlib_writes_the_table_and_warns_once(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "matplotlib")
    grads = [("embed.weight", torch.ones(4, 3)), ("head.weight", torch.full((2, 3), 0.5))]
    table = inspect_gradients(grads, tmp_path, 7, ClipGroups([n for n, _ in grads], None, 1.0))
    assert table == tmp_path / "grads_step7.tsv" and len(table.read_text().splitlines()) == 3
    assert not (tmp_path / "grads_step7.png").exists()
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("trainloop: warning: ") and install_hint("plot") in line


def test_plots_leave_the_matplotlib_backend_and_pyplot_alone(tmp_path):
    # A fresh interpreter: the caller picked the svg backend; plotting must not switch it nor import pyplot.
    metrics = _metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    code = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "from trainloop import plot_metrics\n"
        f"out = plot_metrics({str(metrics)!r}, {str(tmp_path / 'm.png')!r})\n"
        "assert out.read_bytes()[:8] == b'\\x89PNG\\r\\n\\x1a\\n'\n"
        "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "False"]


@pytest.mark.parametrize(("module", "extra", "kwargs"), [
    ("tensorboard", "tensorboard", {"tensorboard": True}),
    ("wandb", "wandb", {"tensorboard": False, "wandb_project": "p"}),
])  # fmt: skip
def test_logger_asked_for_but_missing_warns_one_line(module, extra, kwargs, monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, module)
    logger = MetricsLogger(tmp_path, enabled=True, resume_step=None, **kwargs)
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("trainloop: warning: ") and install_hint(extra) in line
    assert logger.tb is None and logger.wandb is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_is_off_by_default(tmp_path, capsys):
    assert TrainConfig().tensorboard is False and TrainConfig().wandb_project is None
    torch.manual_seed(0)
    Trainer(TinyLM(), _cfg(max_steps=2), SeqData(4), run_dir=tmp_path).fit()
    assert not (tmp_path / "tensorboard").exists()
    assert "warning" not in capsys.readouterr().err


def _scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_event_file_after_a_resume_holds_every_step_once(tmp_path):
    def fit(max_steps, resume):
        torch.manual_seed(0)
        cfg = _cfg(max_steps=max_steps, t_max=6, save_every=3, keep_last=5, tensorboard=True)
        Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path).fit(resume=resume)

    fit(5, False)  # checkpoints at steps 3 and 5, scalars for steps 1-5
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000005")  # as if the job died before step 5's checkpoint
    fit(6, True)  # resumes at step 3: steps 4 and 5 are logged again, then 6
    steps = [s for s, _ in _scalars(tmp_path / "tensorboard", "loss")]
    assert steps == [1, 2, 3, 4, 5, 6]
    jsonl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in jsonl if "loss" in r}
    for step, value in _scalars(tmp_path / "tensorboard", "loss"):
        assert value == pytest.approx(by_step[step], rel=1e-6)


def test_installed_deepspeed_lies_in_the_declared_range():
    import deepspeed

    declared = [Requirement(r) for r in importlib.metadata.requires(DIST) or []]
    (req,) = [r for r in declared if r.name == "deepspeed"]
    assert req.marker is not None and req.marker.evaluate({"extra": "deepspeed"})
    assert req.specifier.contains(deepspeed.__version__), f"deepspeed {deepspeed.__version__} is outside {req}"
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__


def test_plot_leaves_out_a_line_cut_short_by_a_crash(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    with metrics.open("a") as f:
        f.write('{"step": 4, "lo')  # the process died mid-write
    assert plot_metrics(metrics, tmp_path / "m.png").stat().st_size > 0


def test_install_hint_names_the_checkout_directory_pip_installed_from(monkeypatch, tmp_path):
    import json
    from importlib import metadata

    checkout = tmp_path / "packages" / "PKG"
    checkout.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    recorded = {"none": None, "wheel": {"url": "https://example.org/x.whl", "archive_info": {}},
                "dir": {"url": checkout.as_uri(), "dir_info": {}},
                "editable": {"url": checkout.as_uri(), "dir_info": {"editable": True}}}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    hints = {}
    for kind, info in recorded.items():

        class Dist:
            def read_text(self, name, info=info):
                return None if info is None else json.dumps(info)

        monkeypatch.setattr(metadata, "distribution", lambda dist: Dist())
        hints[kind] = install_hint("EXTRA", "dist-name")
    assert hints["none"] == hints["wheel"] == "pip install 'dist-name[EXTRA]'"  # no checkout recorded
    assert hints["dir"] == 'pip install "packages/PKG[EXTRA]"'
    assert hints["editable"] == 'pip install -e "packages/PKG[EXTRA]"'
