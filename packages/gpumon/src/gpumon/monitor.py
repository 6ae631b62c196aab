"""`Monitor`: the library entry point, a context manager around the backends and the sampler."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gpumon.host_backend import DEFAULT_PERIODS as HOST_PERIODS
from gpumon.host_backend import HostBackend
from gpumon.nvml_backend import DEFAULT_PERIODS as NVML_PERIODS
from gpumon.nvml_backend import NVMLBackend
from gpumon.nvml_devices import NVMLUnavailable
from gpumon.recording import IF_EXISTS
from gpumon.sampler import Sampler
from gpumon.statistics import Summary

BACKENDS = ("auto", "nvml", "host")


class Monitor:
    """Sample GPUs (NVML) and/or the host at `rate_hz` in a background thread while the `with` block runs.

    backend: "auto" = NVML and host when a driver is present, else host only with a warning; "nvml" = GPUs only
    (raises NVMLUnavailable on entry without a driver); "host" = CPU % and the process tree's RSS only.
    out: a CSV file written as the run goes (format in the README); None keeps only the in-memory summary. On a
    filesystem that several nodes or restarts share, `gpumon.recording_path(directory)` gives a new per-host name.
    if_exists: what to do when `out` already holds a recording: "error" (the default: raise RecordingExistsError on
    start; an empty file is written into), "overwrite" (truncate it) or "append" (add this run after it).
    pid: root of the process tree the host backend follows (default: this process).
    periods: per-metric-group poll periods in seconds, overriding the defaults; NVML groups by name (memory, power,
    temperature, clocks, clock_events, utilization, pcie, processes), host groups as "host.cpu" / "host.memory".

    Once started, a Monitor never raises into the program: errors are counted and shown by `summary()`.

    Example (`simulated_gpus()` puts two simulated GPUs where a driver would be; on a GPU host leave it out):
        >>> import tempfile, time
        >>> import gpumon
        >>> from gpumon.fake_nvml import simulated_gpus
        >>> run = tempfile.TemporaryDirectory()
        >>> with simulated_gpus(), gpumon.Monitor(rate_hz=100, out=f"{run.name}/gpu.csv") as mon:
        ...     for step in range(3):
        ...         time.sleep(0.02)  # a training step
        ...         mon.mark("step", step)
        >>> [d.get("name") for d in mon.devices]  # the GPUs, then the host
        ['Fake GPU 0', 'Fake GPU 1', None]
        >>> print(mon.summary())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        gpumon: ... samples, achieved ... Hz (target 100), p99 interval error ... ms, ... missed ticks
        sampler cost: ...
        metric unit peak mean p50 p95 p99 last fresh errors
        gpu0.memory_used_bytes GiB ...
        marks: 3
        >>> run.cleanup()
    """

    def __init__(
        self,
        rate_hz: float = 100.0,
        out: str | os.PathLike[str] | None = None,
        backend: str = "auto",
        *,
        pid: int | None = None,
        periods: Mapping[str, float | None] | None = None,
        if_exists: str = "error",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists must be one of {IF_EXISTS}, got {if_exists!r}")
        if not (isinstance(rate_hz, (int, float)) and 0 < rate_hz <= 10_000):
            raise ValueError(f"rate_hz must be a number in (0, 10000], got {rate_hz!r}")
        allowed = set(NVML_PERIODS) | {f"host.{k}" for k in HOST_PERIODS}
        unknown = sorted(set(periods or {}) - allowed)
        if unknown:
            raise ValueError(f"periods: unknown metric group(s) {unknown}; allowed: {sorted(allowed)}")
        self.rate_hz = float(rate_hz)
        self.out = None if out is None else Path(out)
        self.backend = backend
        self.pid = pid
        self.periods = dict(periods or {})
        self.if_exists = if_exists
        self.backends: list[Any] = []
        self.devices: list[dict[str, Any]] = []
        self.fallback_reason: str | None = None
        self._sampler: Sampler | None = None

    def _open_backends(self) -> None:
        nvml_periods = {k: v for k, v in self.periods.items() if not k.startswith("host.")}
        host_periods = {k[5:]: v for k, v in self.periods.items() if k.startswith("host.")}
        if self.backend in ("auto", "nvml"):
            try:
                nvml = NVMLBackend(nvml_periods)
            except NVMLUnavailable as exc:
                if self.backend == "nvml":
                    raise
                self.fallback_reason = str(exc)
            else:
                if nvml.devices or self.backend == "nvml":
                    self.backends.append(nvml)
                else:
                    nvml.close()
                    self.fallback_reason = "NVML works but no GPU is visible (CUDA_VISIBLE_DEVICES)"
            if self.fallback_reason is not None:
                warnings.warn(f"gpumon: {self.fallback_reason}; monitoring the host only", stacklevel=3)
        if self.backend in ("auto", "host"):
            self.backends.append(HostBackend(self.pid, host_periods))
        for b in self.backends:
            self.devices.extend(b.device_info)

    def start(self) -> Monitor:
        """Open the backends and start sampling (what `with` does)."""
        if self._sampler is not None:
            raise RuntimeError("Monitor.start(): already started; a Monitor records one run")
        self._open_backends()
        try:
            pollers = [p for b in self.backends for p in b.pollers]
            meta = {"backends": [b.name for b in self.backends], "devices": self.devices, "pid": self.pid}
            self._sampler = Sampler(pollers, self.rate_hz, self.out, meta=meta, if_exists=self.if_exists)
        except BaseException:
            self._close_backends()
            raise
        self._sampler.start()
        return self

    def stop(self) -> None:
        """Stop sampling, finish the file and release NVML. Never raises; safe to call twice."""
        if self._sampler is not None:
            self._sampler.stop()
        self._close_backends()

    def _close_backends(self) -> None:
        for b in self.backends:
            # releasing NVML after a lost GPU can fail; there is nothing more to do then
            with contextlib.suppress(Exception):
                b.close()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        self.stop()
        return None

    def mark(self, name: str, value: Any = None) -> None:
        """Annotate the timeline (e.g. `mark("step", 12)`); written with its own timestamp. Never raises."""
        try:
            if self._sampler is not None:
                self._sampler.mark(name, value)
        except Exception:  # an annotation is never worth breaking the training loop for
            pass

    def latest(self) -> dict[str, Any]:
        """The most recent value of every metric, by column name (`gpu0.memory_used_bytes`, ...)."""
        return {} if self._sampler is None else self._sampler.latest()

    def status(self) -> dict[str, Any]:
        """Cheap progress figures for a live display: ticks, achieved_rate_hz, errors (a count)."""
        return {"ticks": 0, "achieved_rate_hz": 0.0, "errors": 0} if self._sampler is None else self._sampler.status()

    @property
    def columns(self) -> list[str]:
        return [] if self._sampler is None else list(self._sampler.columns)

    @property
    def units(self) -> dict[str, str]:
        return {} if self._sampler is None else dict(self._sampler.units)

    def summary(self) -> Summary:
        """Peaks, p50/p95/p99, time-weighted means, energy, achieved rate, the sampler's own cost and errors.

        Callable during the run (a snapshot) or after it; `print()` it for a table, `.to_dict()` for JSON.
        """
        if self._sampler is None:
            raise RuntimeError("Monitor.summary(): the monitor was never started")
        return self._sampler.summary()
