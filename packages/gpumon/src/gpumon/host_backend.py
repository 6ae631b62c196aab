"""Host backend (psutil): CPU utilisation and the resident memory of the monitored process tree.

A CPU training run gets a timeline too. The process tree (the root and all its descendants) is re-listed once a
second because walking /proc for children costs far more than reading the RSS of known processes. RSS is summed
over the tree, so pages shared between processes count once per process (as `top` would show them).
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from gpumon.pollers import Failure, Poller

DEFAULT_PERIODS: dict[str, float] = {
    "cpu": 0.1,  # /proc/stat counts in 10 ms ticks: below ~0.1 s a CPU percentage is mostly quantisation
    # RSS is exact at any rate, but a process tree's resident memory moves on the scale of allocator arenas and
    # checkpoint buffers (tens of ms and up); 10 Hz keeps the curve while costing a tenth of a pread per process
    # every tick (the tree itself is re-listed once a second, TREE_REFRESH_S)
    "memory": 0.1,
}
TREE_REFRESH_S = 1.0
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostBackend:
    """Pollers for host CPU % and the process tree's CPU % and RSS.

    Example:
        >>> backend = HostBackend(pid=os.getpid())
        >>> [p.name for p in backend.pollers]
        ['host.cpu', 'host.memory']
    """

    name = "host"

    def __init__(self, pid: int | None = None, periods: dict[str, float] | None = None) -> None:
        unknown = sorted(set(periods or {}) - set(DEFAULT_PERIODS))
        if unknown:
            raise ValueError(f"periods: unknown host metric group(s) {unknown}; allowed: {sorted(DEFAULT_PERIODS)}")
        self.periods = {**DEFAULT_PERIODS, **(periods or {})}
        self.pid = os.getpid() if pid is None else pid
        try:
            self.root = psutil.Process(self.pid)
        except psutil.Error as exc:
            raise ValueError(f"pid {self.pid}: no such process to monitor ({exc})") from None
        self._tree: list[psutil.Process] = []
        self._statm: dict[int, int] = {}  # pid -> open fd of /proc/<pid>/statm
        self._tree_listed_at = -float("inf")
        self._last_cpu_time: float | None = None
        self._last_cpu_wall = 0.0
        psutil.cpu_percent(interval=None)  # the first call only primes psutil's counters
        self.device_info = [{"host": os.uname().nodename, "cpu_count": psutil.cpu_count(), "pid": self.pid}]
        self.pollers = [
            Poller(
                "host.cpu",
                "host",
                ["host.cpu_pct", "host.tree_cpu_pct"],
                ["%", "%"],
                self.periods["cpu"],
                self.read_cpu,
                classify=self.classify,
            ),
            Poller(
                "host.memory",
                "host",
                ["host.tree_rss_bytes", "host.tree_processes"],
                ["B", "count"],
                self.periods["memory"],
                self.read_memory,
                classify=self.classify,
            ),
        ]

    def close(self) -> None:
        self._tree = []
        self._close_statm(set())

    def _close_statm(self, keep: set[int]) -> None:
        for pid in [p for p in self._statm if p not in keep]:
            with contextlib.suppress(OSError):
                os.close(self._statm.pop(pid))

    def classify(self, exc: BaseException) -> Failure:
        # The monitored root exiting ends the tree: that is "lost", not an error to retry 100 times a second.
        if isinstance(exc, psutil.NoSuchProcess) and exc.pid == self.pid:
            return "lost"
        return "error"

    def _processes(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._tree_listed_at >= TREE_REFRESH_S or not self._tree:
            self._tree = [self.root, *self.root.children(recursive=True)]
            self._tree_listed_at = now
            pids = {p.pid for p in self._tree}
            self._close_statm(pids)
            for pid in pids - set(self._statm):
                with contextlib.suppress(OSError):  # no /proc (macOS) or already gone: psutil is the fallback
                    self._statm[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        return self._tree

    def read_memory(self) -> list[int]:
        rss, alive = 0, 0
        for proc in self._processes():
            try:
                fd = self._statm.get(proc.pid)
                if fd is not None:
                    # one pread on a kept-open /proc file costs a fraction of psutil's open/read/close
                    rss += int(os.pread(fd, 128, 0).split()[1]) * PAGE_SIZE
                else:
                    rss += proc.memory_info().rss
                alive += 1
            except ProcessLookupError:
                if proc.pid == self.pid:
                    raise psutil.NoSuchProcess(proc.pid) from None
            except psutil.NoSuchProcess:
                if proc.pid == self.pid:
                    raise
        return [rss, alive]

    def read_cpu(self) -> list[float]:
        system = psutil.cpu_percent(interval=None)
        total = 0.0
        for proc in self._processes():
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                if proc.pid == self.pid:
                    raise
                continue
            # children_* hold the time of descendants already reaped (they left the tree but used the CPU).
            total += t.user + t.system + t.children_user + t.children_system
        now = time.monotonic()
        tree = 0.0
        if self._last_cpu_time is not None and now > self._last_cpu_wall:
            tree = max(0.0, 100.0 * (total - self._last_cpu_time) / (now - self._last_cpu_wall))
        self._last_cpu_time, self._last_cpu_wall = total, now
        return [round(system, 1), round(tree, 1)]
