"""Summaries of recorded files and the text table that `print(summary)` shows."""

from __future__ import annotations

import os
from typing import Any

from gpumon.recording import FAILED, MISSING, STALE, Recording, parse_cell
from gpumon.statistics import Summary, SummaryBuilder

# Native unit -> (display unit, divisor). Values stay native in files and in Summary.to_dict().
DISPLAY = {"B": ("GiB", 2**30), "mW": ("W", 1000.0), "mJ": ("J", 1000.0), "KB/s": ("MB/s", 1000.0)}


def summarize_recording(path: str | os.PathLike[str]) -> Summary:
    """Summarise a recording in one streaming pass (bounded memory whatever the file size).

    Example (a recording of two simulated GPUs from `gpumon.fake_nvml`):
        >>> import tempfile
        >>> from gpumon import Recording
        >>> from gpumon.fake_nvml import simulated_recording
        >>> run = tempfile.TemporaryDirectory()
        >>> path = simulated_recording(f"{run.name}/gpu.csv")
        >>> s = summarize_recording(path)
        >>> s.samples == Recording(path).trailer["ticks"], s.marks  # the ticks the live sampler counted
        (True, 1)
        >>> print(s)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        gpumon: ... samples, achieved ... Hz (target 100), p99 interval error ... ms, ... missed ticks
        sampler cost: ...
        metric unit peak mean p50 p95 p99 last fresh errors
        gpu0.memory_used_bytes GiB ...
        marks: 1
        >>> run.cleanup()
    """
    rec = Recording(path)
    units = {c: rec.units.get(c, "") for c in rec.columns}  # column order, as the live summary shows them
    builder = SummaryBuilder(float(rec.meta.get("rate_hz", 100.0)), units, set(rec.meta.get("counters", [])))
    stats = [builder.metrics.get(c) for c in rec.columns]
    last: list[Any] = [None] * len(rec.columns)
    message: dict[str, tuple[str, str]] = {}
    for t, kind, label, value, cells in rec.rows():
        if kind == "mark":
            builder.marks += 1
            continue
        if kind == "error":
            failure, _, text = value.partition(": ")
            message[label] = (text, failure)
            continue
        if kind == "segment":
            builder.add_segment()
            continue
        if kind != "s":
            continue
        builder.add_tick(t)
        for i, cell in enumerate(cells):
            stat = stats[i]
            if cell == MISSING or stat is None:
                continue
            column = rec.columns[i]
            if cell == FAILED:
                text, failure = message.get(column, ("read failed", "error"))
                builder.add_error(column, text, failure)
            elif cell == STALE:
                stat.add_stale(t, last[i])
            else:
                last[i] = parse_cell(cell)
                stat.add(t, last[i], True)
    trailer = rec.trailer or {}
    return builder.finish(busy_s=trailer.get("busy_s"), cpu_s=trailer.get("cpu_s"))


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bitmask":
        return hex(int(value))
    if not isinstance(value, (int, float)):
        return str(value)[:24]
    value = value / DISPLAY.get(unit, (unit, 1))[1]
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def render_summary(s: Summary) -> str:
    """The summary as a plain-text table (units converted for reading: GiB, W, J, MB/s)."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"gpumon: {s.duration_s:.2f} s, {s.samples} samples, achieved {num(s.achieved_rate_hz, '.1f')} Hz "
        f"(target {s.rate_hz:g}), p99 interval error {num(s.interval_error_p99_ms, '.3f')} ms, "
        f"{s.missed_ticks} missed ticks",
        f"sampler cost: {num(s.sampler_us_per_sample, '.1f')} us/sample, "
        f"{num(s.sampler_cpu_percent, '.2f')}% of one core"
        + ("" if s.percentiles_exact else " (percentiles from a uniform sample of each metric)"),
    ]
    head = ("metric", "unit", "peak", "mean", "p50", "p95", "p99", "last", "fresh", "errors")
    rows = [head]
    for name, m in s.metrics.items():
        unit = m["unit"]
        shown = DISPLAY.get(unit, (unit, 1))[0]
        cells: tuple[str, ...]
        if m.get("increase") is not None:  # a counter: its peak is meaningless, its increase is the point
            cells = ("-", "-", "-", "-", "-", _fmt(m["increase"], unit) + " total")
        else:
            cells = tuple(_fmt(m.get(k), unit) for k in ("peak", "mean", "p50", "p95", "p99", "last"))
        fresh = "-" if m["fresh_fraction"] is None else f"{100 * m['fresh_fraction']:.0f}%"
        rows.append((name, shown, *cells, fresh, str(m["errors"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    for group, joules in s.energy_j.items():
        extra = s.energy_from_power_j.get(group)
        lines.append(
            f"energy {group}: {joules:.1f} J from the energy counter"
            + ("" if extra is None else f", {extra:.1f} J from integrated instant power")
        )
    if s.marks:
        lines.append(f"marks: {s.marks}")
    if s.lost:
        lines.append(f"lost during the run: {', '.join(s.lost)}")
    if s.unsupported:
        lines.append(f"not supported here: {', '.join(s.unsupported)}")
    for key, count in sorted(s.errors.items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"error x{count}: {key}")
    if len(s.errors) > 10:
        lines.append(f"... and {len(s.errors) - 10} more distinct errors")
    return "\n".join(lines)
