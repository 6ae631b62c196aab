"""The `gpumon` command: watch, record, summary, plot.

Exit codes: 0 success; 2 for a usage problem, a missing driver (`watch` without `--host`) or an unreadable file;
`record -- CMD` exits with CMD's own code (128 + N when a signal N ended it, 127 when it could not start).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from gpumon.monitor import Monitor
from gpumon.nvml_devices import NVMLUnavailable
from gpumon.recording import RecordingError
from gpumon.reports import DISPLAY, summarize_recording


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumon", description="100 Hz GPU monitoring through NVML.")
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="live table of every GPU (or of the host with --host)")
    watch.add_argument("--rate", type=float, default=100.0, help="sampling rate in Hz (default 100)")
    watch.add_argument("--refresh", type=float, default=0.5, help="seconds between table redraws (default 0.5)")
    watch.add_argument("--host", action="store_true", help="watch CPU and memory instead of GPUs")
    watch.add_argument("--iterations", type=int, default=None, help="redraw this many times, then exit")
    record = sub.add_parser("record", help="record to a file while CMD runs (after --) or until Ctrl-C")
    record.add_argument("-o", "--out", required=True, help="CSV file to write")
    record.add_argument("--rate", type=float, default=100.0, help="sampling rate in Hz (default 100)")
    record.add_argument("--host", action="store_true", help="record the host only, even where GPUs exist")
    record.add_argument("--duration", type=float, default=None, help="without CMD: stop after this many seconds")
    summary = sub.add_parser("summary", help="summarise a recorded file")
    summary.add_argument("file")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    plot = sub.add_parser("plot", help="plot a recorded file to a PNG")
    plot.add_argument("file")
    plot.add_argument("-o", "--out", required=True, help="PNG to write")
    return parser


def _err(message: str) -> None:
    print(f"gpumon: {message}", file=sys.stderr)


def _rate_ok(rate: float) -> bool:
    if 0 < rate <= 10_000:
        return True
    _err(f"--rate must be in (0, 10000] Hz, got {rate}")
    return False


UNIT_SUFFIXES = ("_bytes", "_mw", "_mj", "_mhz", "_pct", "_kbps", "_c")
SKIPPED_IN_WATCH = ("energy_mj", "processes")  # a driver-lifetime counter; a pid listing too wide for a table


def _format(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bitmask":
        return hex(int(value))
    scale = DISPLAY.get(unit, (unit, 1))[1]
    return f"{value / scale:.4g}" if isinstance(value, (int, float)) else str(value)


def _header(metric: str, unit: str) -> tuple[str, str]:
    name = next((metric[: -len(s)] for s in UNIT_SUFFIXES if metric.endswith(s)), metric)
    shown = DISPLAY.get(unit, (unit, 1))[0]
    return name, "" if shown in ("count", "bitmask") else shown


def render_table(latest: dict[str, Any], units: dict[str, str]) -> str:
    """One row per GPU (or host), one column per metric (name and unit as a two-line header)."""
    groups: dict[str, dict[str, str]] = {}
    headers: dict[str, tuple[str, str]] = {}
    for column, value in latest.items():
        group, metric = column.split(".", 1)
        if metric in SKIPPED_IN_WATCH:
            continue
        groups.setdefault(group, {})[metric] = _format(value, units.get(column, ""))
        headers.setdefault(metric, _header(metric, units.get(column, "")))
    metrics = list(headers)
    rows = [["", *(headers[m][0] for m in metrics)], ["", *(headers[m][1] for m in metrics)]]
    rows += [[g, *(vals.get(m, "") for m in metrics)] for g, vals in groups.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def cmd_watch(args: argparse.Namespace) -> int:
    if not _rate_ok(args.rate):
        return 2
    try:
        mon = Monitor(rate_hz=args.rate, backend="host" if args.host else "nvml").start()
    except NVMLUnavailable as exc:
        _err(f"cannot watch GPUs: {exc}. Use `gpumon watch --host` to watch CPU and memory instead.")
        return 2
    clear = sys.stdout.isatty()
    shown = 0
    try:
        while args.iterations is None or shown < args.iterations:
            time.sleep(args.refresh)
            frame = render_table(mon.latest(), mon.units)
            status = mon.status()
            head = (
                f"gpumon watch  {time.strftime('%H:%M:%S')}  {status['achieved_rate_hz']:.0f} Hz  "
                f"errors {status['errors']}"
            )
            print(("\x1b[H\x1b[2J" if clear else "") + head + "\n" + frame, flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        mon.stop()
    return 0


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: the shell's 128 + N


def cmd_record(args: argparse.Namespace, command: list[str]) -> int:
    if not _rate_ok(args.rate):
        return 2
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.open("w").close()
    except OSError as exc:
        _err(f"cannot write {out}: {exc}")
        return 2
    child = None
    if command:
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            _err(f"cannot run {command[0]!r}: {exc}")
            return 127
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = Monitor(args.rate, out, "host" if args.host else "auto", pid=None if child is None else child.pid)
        try:
            mon.start()
        except Exception as exc:  # the command must still run to completion and keep its exit code
            _err(f"warning: not recording ({type(exc).__name__}: {exc})")
            mon = None
    for w in caught:
        _err(f"warning: {str(w.message).removeprefix('gpumon: ')}")

    def on_terminate(signum: int, frame: Any) -> None:
        # a scheduler's SIGTERM: pass it on, then finish the file and the summary as for Ctrl-C
        if child is not None and child.poll() is None:
            child.send_signal(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_terminate)
    code = 0
    try:
        if child is not None:
            code = _exit_code(child.wait())
        else:
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
    except KeyboardInterrupt:
        # the child, in our process group, got the same Ctrl-C: let it finish and keep its exit code
        code = _exit_code(child.wait()) if child is not None else 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if mon is not None:
            mon.stop()
    if mon is not None:
        print(mon.summary(), file=sys.stderr)
        _err(f"recorded to {out}")
    return code


def cmd_summary(args: argparse.Namespace) -> int:
    try:
        summary = summarize_recording(args.file)
    except RecordingError as exc:
        _err(str(exc))
        return 2
    print(json.dumps(summary.to_dict(), indent=1, default=str) if args.json else summary)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from gpumon.plotting import MissingExtraError, plot_recording  # matplotlib only for this command

    try:
        path = plot_recording(args.file, args.out)
    except (RecordingError, MissingExtraError) as exc:
        _err(str(exc))
        return 2
    print(f"gpumon: wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpumon` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = _parser().parse_args(argv)
    if command and args.command != "record":
        _err(f"only `record` runs a command after --; got {args.command}")
        return 2
    if args.command == "watch":
        return cmd_watch(args)
    if args.command == "record":
        return cmd_record(args, command)
    if args.command == "summary":
        return cmd_summary(args)
    return cmd_plot(args)
