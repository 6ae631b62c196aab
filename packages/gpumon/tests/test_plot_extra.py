"""`gpumon plot` and the `plot` extra: one line naming it when matplotlib is absent; no backend switch when present."""

import subprocess
import sys

import pytest

from gpumon.cli import main
from gpumon.extras import install_hint
from gpumon.plotting import MissingExtraError, plot_recording

RECORDING = '# gpumon 1 {"rate_hz": 100.0, "units": {"n.count": "count"}}\nt,kind,label,value,n.count\n' + "".join(
    f"0.{k:02d},s,,,{k}\n" for k in range(5)
)


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "rec.csv"
    path.write_text(RECORDING)
    return path


def test_plot_without_matplotlib_is_one_line_naming_the_extra(recording, tmp_path, monkeypatch, capsys):
    # matplotlib looks uninstalled, submodules that earlier tests imported included
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r"gpumon\[plot\]['\"]$|^.*\.\[plot\]\"$"):
        plot_recording(recording, tmp_path / "a.png")
    assert main(["plot", str(recording), "-o", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.strip().endswith(f"plotting needs matplotlib, which is not installed: {install_hint('plot')}")
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "b.png").exists()


def test_plot_leaves_the_matplotlib_backend_and_pyplot_alone(recording, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    # A fresh interpreter: the caller picked the svg backend; plotting must not switch it nor import pyplot.
    code = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "from gpumon.plotting import plot_recording\n"
        f"out = plot_recording({str(recording)!r}, {str(tmp_path / 'p.png')!r})\n"
        "assert out.read_bytes()[:8] == b'\\x89PNG\\r\\n\\x1a\\n'\n"
        "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "False"]


def test_install_hint_names_the_checkout_directory_pip_installed_from(monkeypatch, tmp_path):
    import json
    from importlib import metadata

    checkout = tmp_path / "packages" / "gpumon"
    checkout.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    monkeypatch.chdir(tmp_path)
    for info, expected in ((None, "pip install 'lmtools-gpumon[plot]'"),
                           ({"url": checkout.as_uri(), "dir_info": {}}, 'pip install "packages/gpumon[plot]"'),
                           ({"url": checkout.as_uri(), "dir_info": {"editable": True}},
                            'pip install -e "packages/gpumon[plot]"')):  # fmt: skip

        class Dist:
            def read_text(self, name, info=info):
                return None if info is None else json.dumps(info)

        monkeypatch.setattr(metadata, "distribution", lambda dist: Dist())
        assert install_hint("plot") == expected
