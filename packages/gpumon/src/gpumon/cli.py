"""The `gpumon` command: watch, record, summary, plot.

Exit codes: 0 success; 2 for a usage problem, a missing driver (`watch` without `--host`) or an unreadable file,
with one line `gpumon <command>: error: ...` on stderr; `record -- CMD` exits with CMD's own code (128 + N when a
signal N ended it, 127 when it could not start).

`watch` redraws its table in place on a terminal; where stdout is not one (a log), with `--no-progress` or with
TQDM_DISABLE=1, it prints plain timestamped lines instead, one per GPU (or host) per refresh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from gpumon.monitor import Monitor
from gpumon.nvml_devices import NVMLUnavailable
from gpumon.recording import Recording, RecordingError, open_output, recording_path
from gpumon.reports import DISPLAY, summarize_recording


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `gpumon record: error: argument --rate: ...` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(what: str, low: float, high: float, *, low_open: bool = True, integer: bool = False) -> Any:
    """An argparse type: a finite number in (low, high] (or [low, high]), with the range in its error."""
    left = "(" if low_open else "["
    expected = f"{'a whole number' if integer else 'a number'} in {left}{low:g}, {high:.15g}] {what}".rstrip()

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if not (low < value <= high if low_open else low <= value <= high):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


RATE = _number("Hz", 0, 10_000)
SECONDS = _number("seconds", 0, 86_400)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpumon", description="100 Hz GPU monitoring through NVML.")
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="live table of every GPU (or of the host with --host)")
    watch.add_argument("--rate", type=RATE, default=100.0, help="sampling rate in Hz (default 100)")
    watch.add_argument("--refresh", type=SECONDS, default=0.5, help="seconds between table redraws (default 0.5)")
    watch.add_argument("--host", action="store_true", help="watch CPU and memory instead of GPUs")
    watch.add_argument(
        "--iterations", type=_number("", 0, 10**9, integer=True), help="redraw this many times, then exit"
    )
    watch.add_argument(
        "--no-progress",
        action="store_true",
        help="print timestamped lines instead of redrawing the table in place (the default when stdout is not a "
        "terminal or TQDM_DISABLE=1)",
    )
    record = sub.add_parser("record", help="record to a file while CMD runs (after --) or until Ctrl-C")
    where = record.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--out", help="CSV file to write")
    where.add_argument(
        "--dir",
        help="write DIR/gpumon.<host>.csv, numbered (gpumon.<host>.1.csv, ...) when an earlier run left that file: "
        "one file per node and per restart on a shared filesystem",
    )
    record.add_argument("--rate", type=RATE, default=100.0, help="sampling rate in Hz (default 100)")
    record.add_argument("--host", action="store_true", help="record the host only, even where GPUs exist")
    duration = _number("seconds", 0, 10**9, low_open=False)
    record.add_argument("--duration", type=duration, help="without CMD: stop after this many seconds")
    exists = record.add_mutually_exclusive_group()
    exists.add_argument("--overwrite", action="store_true", help="replace the recording in --out if there is one")
    exists.add_argument("--append", action="store_true", help="add this run to the recording in --out")
    summary = sub.add_parser("summary", help="summarise a recorded file")
    summary.add_argument("file")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    plot = sub.add_parser("plot", help="plot a recorded file to a PNG")
    plot.add_argument("file")
    plot.add_argument("-o", "--out", required=True, help="PNG to write")
    return parser


def _fail(command: str, message: str) -> int:
    print(f"gpumon {command}: error: {message}", file=sys.stderr)
    return 2


def _warn(message: str) -> None:
    print(f"gpumon: warning: {message}", file=sys.stderr)


def _progress_allowed() -> bool:
    """False where TQDM_DISABLE asks for no progress displays (any value but empty, 0, false or no)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("", "0", "false", "no")


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


def render_lines(latest: dict[str, Any], units: dict[str, str], status: dict[str, Any], stamp: str) -> list[str]:
    """For logs: one line per GPU (or host) and one for the sampler, each starting with `stamp`."""
    groups: dict[str, list[str]] = {}
    for column, value in latest.items():
        group, metric = column.split(".", 1)
        if metric in SKIPPED_IN_WATCH:
            continue
        name, unit = _header(metric, units.get(column, ""))
        groups.setdefault(group, []).append(f"{name}={_format(value, units.get(column, ''))}{unit}")
    lines = [f"{stamp} {group} {' '.join(cells)}" for group, cells in groups.items()]
    lines.append(f"{stamp} gpumon rate={status['achieved_rate_hz']:.0f}Hz errors={status['errors']}")
    return lines


def cmd_watch(args: argparse.Namespace) -> int:
    try:
        mon = Monitor(rate_hz=args.rate, backend="host" if args.host else "nvml").start()
    except NVMLUnavailable as exc:
        return _fail("watch", f"cannot watch GPUs: {exc}. Use `gpumon watch --host` to watch CPU and memory instead")
    # redrawing in place only on a terminal: in a log, cursor codes are noise and each redraw would be lost
    live = sys.stdout.isatty() and not args.no_progress and _progress_allowed()
    shown = 0
    try:
        while args.iterations is None or shown < args.iterations:
            time.sleep(args.refresh)
            latest, status = mon.latest(), mon.status()
            if live:
                head = f"gpumon watch  {time.strftime('%H:%M:%S')}  {status['achieved_rate_hz']:.0f} Hz  "
                print(f"\x1b[H\x1b[2J{head}errors {status['errors']}\n{render_table(latest, mon.units)}", flush=True)
            else:
                stamp = datetime.now().isoformat(timespec="milliseconds")
                print("\n".join(render_lines(latest, mon.units, status, stamp)), flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        mon.stop()
    return 0


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: the shell's 128 + N


def _file_in_the_way(directory: Path) -> Path | None:
    """The nearest of `directory` and its parents that exists, when it is not a directory (mkdir would fail)."""
    for path in (directory, *directory.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def _record_path(args: argparse.Namespace) -> Path | str:
    """The file `record` writes, checked before anything starts; a string is the error to report."""
    directory = Path(args.out).parent if args.dir is None else Path(args.dir)
    blocker = _file_in_the_way(directory)
    if blocker is not None:
        return f"cannot write there: {blocker} is a file, not a directory"
    if args.dir is not None:
        try:
            return recording_path(args.dir)
        except OSError as exc:
            return f"cannot create a recording in --dir {args.dir}: {exc.strerror or exc}"
    out = Path(args.out)
    if out.is_dir():
        return f"-o {out} is a directory; give a file name, or use --dir {out} for a per-host file in it"
    if out.is_file() and out.stat().st_size > 0:
        if not (args.append or args.overwrite):
            return f"-o {out} exists already; pass --append or --overwrite, or use --dir for a new per-host file"
        if args.append:
            try:
                Recording(out)
            except RecordingError as exc:
                return f"cannot --append: {exc}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open_output(out, "a"):  # writable, never through a link, and nothing truncated yet
            pass
    except RecordingError as exc:
        return f"cannot write -o {out}: {exc}"
    except OSError as exc:
        return f"cannot write -o {out}: {exc.strerror or exc}"
    return out


def cmd_record(args: argparse.Namespace, command: list[str]) -> int:
    if command and args.duration is not None:
        return _fail("record", "--duration applies without a command; with -- CMD the recording lasts as CMD does")
    if args.dir is not None and (args.append or args.overwrite):
        return _fail("record", "--append and --overwrite apply to -o FILE; --dir always writes a new file")
    out = _record_path(args)
    if isinstance(out, str):
        return _fail("record", out)
    if_exists = "append" if args.append else "overwrite" if args.overwrite else "error"
    child = None
    if command:
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            print(f"gpumon record: error: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pid = None if child is None else child.pid
        mon: Monitor | None
        mon = Monitor(args.rate, out, "host" if args.host else "auto", pid=pid, if_exists=if_exists)
        try:
            mon.start()
        except Exception as exc:  # the command must still run to completion and keep its exit code
            if child is None:
                return _fail("record", f"cannot record to {out}: {exc}")
            _warn(f"not recording ({type(exc).__name__}: {exc})")
            mon = None
    for w in caught:
        _warn(str(w.message).removeprefix("gpumon: "))

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
        print(f"gpumon: recorded to {out}", file=sys.stderr)
    return code


def cmd_summary(args: argparse.Namespace) -> int:
    try:
        summary = summarize_recording(args.file)
    except RecordingError as exc:
        return _fail("summary", str(exc))
    print(json.dumps(summary.to_dict(), indent=1, default=str) if args.json else summary)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from gpumon.plotting import MissingExtraError, plot_recording  # matplotlib only for this command

    if Path(args.out).is_dir():
        return _fail("plot", f"-o {args.out} is a directory; give the PNG file to write")
    try:
        Recording(args.file)  # the file's problems first, whether or not matplotlib is installed
        path = plot_recording(args.file, args.out)
    except (RecordingError, MissingExtraError) as exc:
        return _fail("plot", str(exc))
    except OSError as exc:
        return _fail("plot", f"cannot write -o {args.out}: {exc.strerror or exc}")
    except ValueError as exc:  # matplotlib: an output format it does not know
        return _fail("plot", f"cannot write -o {args.out}: {exc}")
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
        return _fail(args.command, "only `record` runs a command after --")
    if args.command == "watch":
        return cmd_watch(args)
    if args.command == "record":
        return cmd_record(args, command)
    if args.command == "summary":
        return cmd_summary(args)
    return cmd_plot(args)
