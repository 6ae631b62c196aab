"""The recording file: CSV written row by row as the sampler goes (bounded memory for days-long runs).

Layout (documented in the README):

    # gpumon 1 {"rate_hz": 100.0, "start_unix": ..., "units": {...}, "devices": [...], ...}
    t,kind,label,value,gpu0.memory_used_bytes,gpu0.power_instant_mw,...
    0.000000,s,,,1073741824,61000,...
    0.010002,s,,,=,61250,...
    0.013417,mark,step,12
    0.020001,error,gpu1.power_instant_mw,Not Supported
    # end {"ticks": ..., "errors": {...}, "sampler_cpu_s": ..., ...}

`t` is seconds on the monotonic clock since the start (`start_unix` in the header gives the wall time of t=0).
`kind` is `s` for a sample row, `mark` for `Monitor.mark(label, value)`, `error` for the first occurrence of each
distinct error of a metric. Sample cells: a number is a freshly read value that differs from the previous reading;
`=` means the metric was read and NVML returned the same value again (stale); empty means the metric was not due
at this tick (its own poll period is longer) or is no longer read; `!` means the read failed. The `# end` trailer
is written on a clean stop; a file cut short by a crash reads fine without it.

A run appended to an existing recording (`if_exists="append"`) starts with its own header line (a comment) and a
`segment` row; its rows continue on the first run's time axis (shifted by the difference of the wall-clock start
times), and the columns must be the same. A writer never truncates a recording unless told to (`"overwrite"`).
"""

from __future__ import annotations

import csv
import errno
import io
import itertools
import json
import math
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

MAGIC = "# gpumon 1 "
TRAILER = "# end "
FIXED = ["t", "kind", "label", "value"]
STALE, MISSING, FAILED = "=", "", "!"
IF_EXISTS = ("error", "overwrite", "append")
TRAILER_TOTALS = ("ticks", "busy_s", "cpu_s")  # summed over the runs of a file when a run is appended


class RecordingError(ValueError):
    """A file is not a gpumon recording (the message names the file and what is wrong)."""


class RecordingExistsError(FileExistsError):
    """The output file holds a recording already and the writer was not told to overwrite or append to it."""


def host_name() -> str:
    """This machine's name as it goes into a file name: characters other than letters, digits, `.`, `_`, `-` -> `_`."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).lstrip(".") or "host"


def recording_path(directory: str | os.PathLike[str], name: str = "gpumon", *, host: str | None = None) -> Path:
    """A new, empty file for this host's recording in `directory`, which nodes may share: never an existing file.

    The first run on a host gets `<directory>/<name>.<host>.csv`; a restart that finds it gets
    `<name>.<host>.1.csv`, then `.2.csv`, and so on (the lowest number not taken). The file is created exclusively
    (O_CREAT | O_EXCL, which NFS v3 and later honour), so two processes asking at once never get the same path;
    `Monitor` writes into such an empty file without complaint. `host` defaults to `host_name()`.

    Example (`tempfile` stands in for a directory the nodes share):
        >>> import os, tempfile
        >>> shared = tempfile.TemporaryDirectory()
        >>> recording_path(shared.name, host="node03").name
        'gpumon.node03.csv'
        >>> recording_path(shared.name, host="node03").name  # the same host restarted: the first file is kept
        'gpumon.node03.1.csv'
        >>> sorted(os.listdir(shared.name))
        ['gpumon.node03.1.csv', 'gpumon.node03.csv']
        >>> shared.cleanup()

    `gpumon.Monitor(rate_hz=100, out=recording_path("/shared/run7"))` then records into the new file.
    """
    host = host_name() if host is None else host
    for label, text in (("name", name), ("host", host)):
        if not text or not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", text):
            raise ValueError(f"recording_path: {label} {text!r} must be letters, digits, '.', '_' or '-'")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        path = directory / (f"{name}.{host}.csv" if n == 0 else f"{name}.{host}.{n}.csv")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def open_output(path: str | os.PathLike[str], mode: str = "w", **text_options: Any) -> IO[Any]:
    """``path`` opened for writing ("w" empties it, "a" appends, "x" creates it; "wb" in binary), never through a
    link: a symbolic link, a file with other hard links (which emptying or appending would change under its other
    names) or anything but a regular file is a RecordingError (one line) before anything is written.
    ``text_options`` go to ``open`` (``newline``, ``buffering``).

    Example:
        >>> import os, tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> theirs, mine = os.path.join(d.name, "notes.txt"), os.path.join(d.name, "gpu.csv")
        >>> _ = open(theirs, "w").write("keep me")
        >>> os.link(theirs, mine)
        >>> open_output(mine)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        gpumon.recording.RecordingError: .../gpu.csv: has 2 hard links ...
        >>> d.cleanup()
    """
    flags = {"w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}[mode[0]]  # fmt: skip
    fix = "remove it, or write elsewhere"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RecordingError(f"{path}: is a symbolic link: a recording is written only as a file of its own; "
                                 f"{fix}") from None  # fmt: skip
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordingError(f"{path}: is not a regular file; {fix}")
        if st.st_nlink > 1:
            raise RecordingError(f"{path}: has {st.st_nlink} hard links (the same file under other names); {fix}")
        os.set_blocking(fd, True)
        if mode[0] == "w":
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, mode.replace("x", "w"), **text_options)  # noqa: SIM115 (the caller closes it)


class RecordingWriter:
    """Appends rows to a recording; the sampler is its only user.

    `if_exists` decides what happens when `path` is a non-empty file already: "error" raises RecordingExistsError
    (an empty file, such as `recording_path()` leaves, is written into), "overwrite" truncates it, "append" adds
    this run after the runs it holds (same columns required).
    """

    def __init__(
        self, path: str | os.PathLike[str], columns: list[str], meta: dict[str, Any], if_exists: str = "error"
    ) -> None:
        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists must be one of {IF_EXISTS}, got {if_exists!r}")
        self.path = Path(path)
        self.offset = 0.0  # added to every t: an appended run continues on the first run's time axis
        self._previous: dict[str, Any] = {}  # the totals in the trailer of the runs already in the file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existing = self.path.is_file() and self.path.stat().st_size > 0
        self._file: IO[str]
        if existing and if_exists == "error":
            raise RecordingExistsError(
                f"{self.path}: a recording exists already; choose a new file (gpumon.recording_path() numbers "
                "them), or say if_exists='append' or 'overwrite' (gpumon record --append / --overwrite)"
            )
        if existing and if_exists == "append":
            self._file = self._open_for_append(columns, meta)
        else:
            # "x" where there was no file: a writer that appeared meanwhile is never truncated
            mode = "w" if if_exists == "overwrite" or self.path.exists() else "x"
            self._file = open_output(self.path, mode, newline="", buffering=1 << 16)  # closed in close()
            self._file.write(MAGIC + json.dumps(meta, sort_keys=True) + "\n")
            csv.writer(self._file, lineterminator="\n").writerow(FIXED + columns)
        self._write = self._file.write
        self._line = io.StringIO()
        self._line_csv = csv.writer(self._line, lineterminator="\n")  # marks and errors: labels are arbitrary text
        self._file.flush()

    def _open_for_append(self, columns: list[str], meta: dict[str, Any]) -> IO[str]:
        earlier = Recording(self.path)
        if earlier.columns != columns:
            missing = sorted(set(earlier.columns) ^ set(columns)) or "their order"
            raise RecordingError(
                f"{self.path}: cannot append: this run's columns differ from the recording's ({missing}); "
                "write to a new file instead"
            )
        start, first = meta.get("start_unix"), earlier.meta.get("start_unix")
        if isinstance(start, (int, float)) and isinstance(first, (int, float)):
            self.offset = float(start) - float(first)
        self._previous = {k: v for k, v in (earlier.trailer or {}).items() if k in TRAILER_TOTALS}
        with open(self.path, "rb") as f:
            f.seek(-1, io.SEEK_END)
            torn = f.read(1) != b"\n"  # the last line of a run that crashed mid-write
        file = open_output(self.path, "a", newline="", buffering=1 << 16)  # closed in close()
        file.write(("\n" if torn else "") + MAGIC + json.dumps(meta, sort_keys=True) + "\n")
        file.write(f"{self.offset:.6f},segment,,\n")
        return file

    def sample_line(self, t: float, cells: list[str]) -> str:
        """One sample row; `cells` are already CSV-safe (the processor quotes text that needs it)."""
        return f"{t + self.offset:.6f},s,,,{','.join(cells)}\n"

    def event(self, t: float, kind: str, label: str, value: Any) -> None:
        self._write(self.event_line(t, kind, label, value))

    def event_line(self, t: float, kind: str, label: str, value: Any) -> str:
        """A mark or error row, quoted by the csv module (labels are arbitrary text)."""
        self._line.seek(0)
        self._line.truncate()
        self._line_csv.writerow([f"{t + self.offset:.6f}", kind, label, "" if value is None else value])
        return self._line.getvalue()

    def write(self, lines: list[str]) -> None:
        """Rows already formatted by sample_line() and event_line()."""
        self._write("".join(lines))

    def flush(self) -> None:
        self._file.flush()

    def close(self, trailer: dict[str, Any] | None = None) -> None:
        """Write `trailer` (its ticks, busy_s and cpu_s added to those of the runs before, when appended) and close."""
        if self._file.closed:
            return
        if trailer is not None:
            trailer = dict(trailer)
            for key, value in self._previous.items():
                if isinstance(value, (int, float)) and isinstance(trailer.get(key), (int, float)):
                    trailer[key] += value
            self._file.write(TRAILER + json.dumps(trailer, sort_keys=True) + "\n")
        self._file.close()


class Recording:
    """Reads a recording in one streaming pass per call (nothing but the header is kept in memory).

    Raises RecordingError, naming the file and what is wrong, for anything that is not a readable recording.
    Bytes that are not UTF-8 and lines that do not parse (a torn last line, a corrupted stretch) are skipped.

    Example (a recording of two simulated GPUs from `gpumon.fake_nvml`):
        >>> import tempfile
        >>> from gpumon.fake_nvml import simulated_recording
        >>> run = tempfile.TemporaryDirectory()
        >>> rec = Recording(simulated_recording(f"{run.name}/gpu.csv"))
        >>> rec.columns[:2], rec.units["gpu0.memory_used_bytes"]
        (['gpu0.memory_used_bytes', 'gpu0.power_instant_mw'], 'B')
        >>> [(label, value) for t, kind, label, value, cells in rec.rows() if kind == "mark"]
        [('step', '0')]
        >>> run.cleanup()
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise RecordingError(f"{self.path}: is a directory; give the recording's CSV file")
        if not self.path.exists():
            raise RecordingError(f"{self.path}: no such recording file")
        if not self.path.is_file():
            raise RecordingError(f"{self.path}: not a regular file (a recording is a CSV file)")
        try:
            with self._open() as f:
                first = f.readline(1 << 20)
                second = f.readline(1 << 20)
        except OSError as exc:
            raise RecordingError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        if not first.startswith(MAGIC):
            raise RecordingError(f"{self.path}: not a gpumon recording (first line does not start with {MAGIC!r})")
        try:
            self.meta: dict[str, Any] = json.loads(first[len(MAGIC) :])
        except json.JSONDecodeError as exc:
            raise RecordingError(f"{self.path}: header metadata is not valid JSON ({exc})") from None
        self._check_meta()
        header = next(csv.reader([second.replace("\0", "")]), [])
        if header[: len(FIXED)] != FIXED:
            raise RecordingError(f"{self.path}: second line must be the CSV header starting with {FIXED}")
        self.columns: list[str] = header[len(FIXED) :]
        self.units: dict[str, str] = self.meta.get("units", {})
        self.trailer: dict[str, Any] | None = self._read_trailer()

    def _open(self) -> io.TextIOWrapper:
        return open(self.path, newline="", errors="replace")

    def _check_meta(self) -> None:
        meta = self.meta
        problem = None
        if not isinstance(meta, dict):
            problem = "is not a JSON object"
        elif not _all_str(meta.get("units", {}), dict):
            problem = "'units' is not an object of strings"
        elif not _all_str(meta.get("counters", []), list):
            problem = "'counters' is not a list of strings"
        else:
            rate = meta.get("rate_hz", 100.0)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
                problem = f"'rate_hz' must be a positive number, got {rate!r}"
        if problem is not None:
            raise RecordingError(f"{self.path}: header metadata {problem}; the file is damaged or not gpumon's")

    def _read_trailer(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(0, io.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                tail = f.read().decode(errors="replace").rstrip("\n").rsplit("\n", 1)[-1]
        except OSError:
            return None
        if tail.startswith(TRAILER):
            try:
                trailer = json.loads(tail[len(TRAILER) :])
            except json.JSONDecodeError:
                return None
            return trailer if isinstance(trailer, dict) else None
        return None

    def rows(self) -> Iterator[tuple[float, str, str, str, list[str]]]:
        """Yield (t, kind, label, value, cells) for every row; comments and lines that do not parse are skipped."""
        n = len(self.columns)
        try:
            with self._open() as f:
                f.readline(1 << 20)
                f.readline(1 << 20)
                lines = (line for line in f if not line.startswith("#") and "\0" not in line)
                reader = csv.reader(lines)
                while True:
                    try:
                        row = next(reader)
                    except StopIteration:
                        return
                    except csv.Error:  # a damaged line (an over-long field): the reader goes on at the next one
                        continue
                    if len(row) < len(FIXED):
                        continue
                    try:
                        t = float(row[0])
                    except ValueError:
                        continue
                    if not math.isfinite(t):
                        continue
                    cells = row[len(FIXED) :]
                    if row[1] == "s" and len(cells) != n:
                        continue  # the last line of a file cut off mid-write
                    yield t, row[1], row[2], row[3], cells
        except OSError as exc:
            raise RecordingError(f"{self.path}: cannot read the rows ({exc})") from None

    def marks(self) -> list[tuple[float, str, str]]:
        return [(t, label, value) for t, kind, label, value, _ in self.rows() if kind == "mark"]

    def series(self, columns: list[str]) -> dict[str, tuple[list[float], list[float]]]:
        """Numeric (times, values) per column, stale cells filled with the value they repeat."""
        index = {c: self.columns.index(c) for c in columns}
        out: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in columns}
        last: dict[str, float | None] = dict.fromkeys(columns)
        for t, kind, _, _, cells in self.rows():
            if kind != "s":
                continue
            for c, i in index.items():
                cell = cells[i]
                if cell in (MISSING, FAILED):
                    continue
                if cell != STALE:
                    try:
                        last[c] = float(cell)
                    except ValueError:
                        continue
                held = last[c]
                if held is not None:
                    out[c][0].append(t)
                    out[c][1].append(held)
        return out


def _all_str(value: Any, kind: type) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return isinstance(value, kind) and all(isinstance(x, str) for x in items)


def parse_cell(cell: str) -> int | float | str:
    """A fresh cell's value: int, float, or the text itself (the process listing)."""
    try:
        return int(cell)
    except ValueError:
        pass
    try:
        return float(cell)
    except ValueError:
        return cell
