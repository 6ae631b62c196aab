"""`gpumon plot`: timelines of a recording, one panel per metric kind and one line per GPU, with the marks.

matplotlib is the ``plot`` extra (``pip install "packages/gpumon[plot]"`` from a checkout). The figure is drawn on
its own Agg canvas: no pyplot, no ``matplotlib.use``, so plotting never changes the backend of the program that
calls it.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpumon.recording import Recording, open_output

# (panel title, column suffix, divisor to display units)
PANELS = [
    ("memory used (GiB)", ".memory_used_bytes", 2**30),
    ("power, instant (W)", ".power_instant_mw", 1000.0),
    ("power, average (W)", ".power_average_mw", 1000.0),
    ("GPU utilisation (%)", ".util_gpu_pct", 1.0),
    ("SM clock (MHz)", ".sm_clock_mhz", 1.0),
    ("temperature (C)", ".temperature_c", 1.0),
    ("PCIe rx (MB/s)", ".pcie_rx_kbps", 1000.0),
    ("host CPU (%)", "host.cpu_pct", 1.0),
    ("process tree CPU (% of one core)", "host.tree_cpu_pct", 1.0),
    ("process tree RSS (GiB)", "host.tree_rss_bytes", 2**30),
]
MAX_POINTS = 20_000  # per line; longer series keep each bucket's maximum so that peaks survive
MAX_MARK_LINES = 200


class MissingExtraError(ImportError):
    """matplotlib is not installed; the message is the ``pip install`` line that adds it."""


def _decimate(times: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    n = len(values)
    if n <= MAX_POINTS:
        return times, values
    step = -(-n // MAX_POINTS)
    out_t, out_v = [], []
    for start in range(0, n, step):
        chunk = values[start : start + step]
        i = max(range(len(chunk)), key=chunk.__getitem__)
        out_t.append(times[start + i])
        out_v.append(chunk[i])
    return out_t, out_v


def plot_recording(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write a PNG of the recording's timelines (matplotlib's Agg canvas: no display needed).

    Raises :class:`MissingExtraError` without matplotlib, :class:`~gpumon.recording.RecordingError` for a bad file.

    Example (a recording of two simulated GPUs from `gpumon.fake_nvml`):
        >>> import tempfile
        >>> from gpumon.fake_nvml import simulated_recording
        >>> run = tempfile.TemporaryDirectory()
        >>> png = plot_recording(simulated_recording(f"{run.name}/gpu.csv"), f"{run.name}/gpu.png")
        >>> png.name, png.read_bytes()[1:4]  # a PNG file's signature
        ('gpu.png', b'PNG')
        >>> run.cleanup()
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        from gpumon.extras import install_hint

        raise MissingExtraError(f"plotting needs matplotlib, which is not installed: {install_hint('plot')}") from exc

    rec = Recording(path)
    panels = []
    for title, suffix, scale in PANELS:
        columns = [c for c in rec.columns if c.endswith(suffix)]
        if columns:
            panels.append((title, columns, scale))
    series = rec.series([c for _, cols, _ in panels for c in cols])
    panels = [(t, [c for c in cols if series[c][0]], s) for t, cols, s in panels]
    panels = [p for p in panels if p[1]]
    marks = rec.marks()
    fig = Figure(figsize=(11, 2.2 * max(1, len(panels))))
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(panels)), 1, sharex=True, squeeze=False)
    names = sorted({label for _, label, _ in marks})
    colors = {name: f"C{(i + 3) % 10}" for i, name in enumerate(names)}
    stride = max(1, -(-len(marks) // MAX_MARK_LINES))
    for ax, (title, columns, scale) in zip(axes[:, 0], panels, strict=False):
        for column in columns:
            times, values = _decimate(*series[column])
            ax.plot(times, [v / scale for v in values], lw=0.8, drawstyle="steps-post", label=column.split(".", 1)[0])
        for t, label, _ in marks[::stride]:
            ax.axvline(t, color=colors[label], lw=0.5, alpha=0.5)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        if len(columns) > 1:
            ax.legend(fontsize=7, loc="upper right")
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no numeric samples in this recording", ha="center", va="center")
    axes[-1, 0].set_xlabel("seconds since start")
    legend = ", ".join(f"{n} ({colors[n]})" for n in names)
    title = f"{rec.path.name}: {len(marks)} marks" + (f" [{legend}]" if names else "")
    if stride > 1:
        title += f", every {stride}th drawn"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kind = out.suffix.lstrip(".").lower() or "png"
    if kind not in fig.canvas.get_supported_filetypes():  # before the file is created, as savefig(path) does
        raise ValueError(f"Format {kind!r} is not supported (supported formats: "
                         f"{', '.join(sorted(fig.canvas.get_supported_filetypes()))})")  # fmt: skip
    with open_output(out, "wb") as f:  # never through a link
        fig.savefig(f, dpi=100, format=kind)
    return out
