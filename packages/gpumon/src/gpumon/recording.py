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
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAGIC = "# gpumon 1 "
TRAILER = "# end "
FIXED = ["t", "kind", "label", "value"]
STALE, MISSING, FAILED = "=", "", "!"


class RecordingError(ValueError):
    """A file is not a gpumon recording (the message names the file and what is wrong)."""


class RecordingWriter:
    """Appends rows to a recording; the sampler thread is its only user."""

    def __init__(self, path: str | os.PathLike[str], columns: list[str], meta: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", newline="", buffering=1 << 16)  # noqa: SIM115 (closed in close())
        self._csv = csv.writer(self._file, lineterminator="\n")  # marks and errors: labels are arbitrary text
        self._write = self._file.write
        self._line = io.StringIO()
        self._line_csv = csv.writer(self._line, lineterminator="\n")
        self._file.write(MAGIC + json.dumps(meta, sort_keys=True) + "\n")
        self._csv.writerow(FIXED + columns)
        self._file.flush()

    @staticmethod
    def sample_line(t: float, cells: list[str]) -> str:
        """One sample row; `cells` are already CSV-safe (the sampler quotes text that needs it)."""
        return f"{t:.6f},s,,,{','.join(cells)}\n"

    def event(self, t: float, kind: str, label: str, value: Any) -> None:
        self._write(self.event_line(t, kind, label, value))

    def event_line(self, t: float, kind: str, label: str, value: Any) -> str:
        """A mark or error row, quoted by the csv module (labels are arbitrary text)."""
        self._line.seek(0)
        self._line.truncate()
        self._line_csv.writerow([f"{t:.6f}", kind, label, "" if value is None else value])
        return self._line.getvalue()

    def write(self, lines: list[str]) -> None:
        """Rows already formatted by sample_line() and event_line()."""
        self._write("".join(lines))

    def flush(self) -> None:
        self._file.flush()

    def close(self, trailer: dict[str, Any] | None = None) -> None:
        if self._file.closed:
            return
        if trailer is not None:
            self._file.write(TRAILER + json.dumps(trailer, sort_keys=True) + "\n")
        self._file.close()


class Recording:
    """Reads a recording in one streaming pass per call (nothing but the header is kept in memory).

    Example:
        >>> rec = Recording("run/gpu.csv")
        >>> rec.columns[:2], rec.units["gpu0.memory_used_bytes"]
        >>> for t, kind, label, value, cells in rec.rows(): ...
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise RecordingError(f"{self.path}: no such recording file")
        with open(self.path, newline="") as f:
            first = f.readline()
            if not first.startswith(MAGIC):
                raise RecordingError(f"{self.path}: not a gpumon recording (first line does not start with {MAGIC!r})")
            try:
                self.meta: dict[str, Any] = json.loads(first[len(MAGIC) :])
            except json.JSONDecodeError as exc:
                raise RecordingError(f"{self.path}: header metadata is not valid JSON ({exc})") from None
            header = next(csv.reader([f.readline()]), [])
        if header[: len(FIXED)] != FIXED:
            raise RecordingError(f"{self.path}: second line must be the CSV header starting with {FIXED}")
        self.columns: list[str] = header[len(FIXED) :]
        self.units: dict[str, str] = self.meta.get("units", {})
        self.trailer: dict[str, Any] | None = self._read_trailer()

    def _read_trailer(self) -> dict[str, Any] | None:
        with open(self.path, "rb") as f:
            f.seek(0, io.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode(errors="replace").rstrip("\n").rsplit("\n", 1)[-1]
        if tail.startswith(TRAILER):
            try:
                return json.loads(tail[len(TRAILER) :])
            except json.JSONDecodeError:
                return None
        return None

    def rows(self) -> Iterator[tuple[float, str, str, str, list[str]]]:
        """Yield (t, kind, label, value, cells) for every row; comment lines and a torn last line are skipped."""
        n = len(self.columns)
        with open(self.path, newline="") as f:
            f.readline()
            f.readline()
            for row in csv.reader(line for line in f if not line.startswith("#")):
                if len(row) < len(FIXED):
                    continue
                try:
                    t = float(row[0])
                except ValueError:
                    continue
                cells = row[len(FIXED) :]
                if row[1] == "s" and len(cells) != n:
                    continue  # the last line of a file cut off mid-write
                yield t, row[1], row[2], row[3], cells

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
                if last[c] is not None:
                    out[c][0].append(t)
                    out[c][1].append(last[c])
        return out


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
