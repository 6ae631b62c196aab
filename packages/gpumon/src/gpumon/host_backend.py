"""Host backend (psutil): CPU utilisation and the resident memory of the monitored process tree.

A CPU training run gets a timeline too. The process tree (the root and all its descendants) is re-listed once a
second because listing children costs far more than reading the RSS of known processes. On Linux every read is a
pread on a /proc file kept open (statm, stat, /proc/stat) and children come from /proc/<pid>/task/<tid>/children:
psutil's generic path (open, read, close, parse, and a scan of every /proc entry for children) cost several times
more per tick, which matters at 100 Hz. psutil remains the fallback wherever /proc is missing. RSS is summed
over the tree, so pages shared between processes count once per process (as `top` would show them).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

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
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def proc_children(pid: int) -> list[int] | None:
    """Direct children of `pid` from /proc/<pid>/task/<tid>/children (Linux 3.5+); None where unavailable."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return [] if os.path.isdir("/proc/self/task") else None  # the process is gone, or there is no /proc
    children: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                children.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None  # the thread exists but the file does not: a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue  # the thread ended while listing
    return children


class HostBackend:
    """Pollers for host CPU % and the process tree's CPU % and RSS.

    Example:
        >>> backend = HostBackend(pid=os.getpid())
        >>> [p.name for p in backend.pollers]
        ['host.cpu', 'host.memory']
    """

    name = "host"

    def __init__(self, pid: int | None = None, periods: Mapping[str, float | None] | None = None) -> None:
        unknown = sorted(set(periods or {}) - set(DEFAULT_PERIODS))
        if unknown:
            raise ValueError(f"periods: unknown host metric group(s) {unknown}; allowed: {sorted(DEFAULT_PERIODS)}")
        # Monitor passes its "host.*" periods here, from a mapping where None is allowed for NVML's utilization
        self.periods: dict[str, float] = {}
        for key, value in {**DEFAULT_PERIODS, **(periods or {})}.items():
            if value is None:
                raise ValueError(
                    f"host periods[{key!r}] must be >= 0 seconds, got None (None, a GPU's own refresh window, is for "
                    "NVML's 'utilization' only)"
                )
            self.periods[key] = value
        self.pid = os.getpid() if pid is None else pid
        try:
            self.root = psutil.Process(self.pid)
        except psutil.Error as exc:
            raise ValueError(f"pid {self.pid}: no such process to monitor ({exc})") from None
        self._tree: list[psutil.Process] = []
        self._statm: dict[int, int] = {}  # pid -> open fd of /proc/<pid>/statm
        self._stat: dict[int, int] = {}  # pid -> open fd of /proc/<pid>/stat
        self._known: dict[int, psutil.Process] = {self.pid: self.root}
        self._proc_stat = _open("/proc/stat")
        self._last_system: tuple[int, int] | None = None
        self._tree_listed_at = -float("inf")
        self._last_cpu_time: float | None = None
        self._last_cpu_wall = 0.0
        psutil.cpu_percent(interval=None)  # the first call only primes psutil's counters (the fallback)
        if self._proc_stat is not None:
            self._system_cpu()
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
        self._close_fds(set())
        if self._proc_stat is not None:
            with contextlib.suppress(OSError):
                os.close(self._proc_stat)
            self._proc_stat = None

    def _close_fds(self, keep: set[int]) -> None:
        for fds in (self._statm, self._stat):
            for pid in [p for p in fds if p not in keep]:
                with contextlib.suppress(OSError):
                    os.close(fds.pop(pid))

    def _descendants(self) -> list[int] | None:
        found, frontier = [], [self.pid]
        while frontier:
            pid = frontier.pop()
            children = proc_children(pid)
            if children is None:
                return None
            found.extend(children)
            frontier.extend(children)
        return found

    def classify(self, exc: BaseException) -> Failure:
        # The monitored root exiting ends the tree: that is "lost", not an error to retry 100 times a second.
        if isinstance(exc, psutil.NoSuchProcess) and exc.pid == self.pid:
            return "lost"
        return "error"

    def _processes(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._tree_listed_at >= TREE_REFRESH_S or not self._tree:
            pids = self._descendants()
            if pids is None:
                self._tree = [self.root, *self.root.children(recursive=True)]
            else:
                tree = [self.root]
                for pid in dict.fromkeys(pids):
                    proc = self._known.get(pid)
                    if proc is None:
                        with contextlib.suppress(psutil.Error):
                            proc = psutil.Process(pid)
                    if proc is not None:
                        tree.append(proc)
                self._tree = tree
            self._known = {p.pid: p for p in self._tree}
            self._tree_listed_at = now
            alive = set(self._known)
            self._close_fds(alive)
            for fds, name in ((self._statm, "statm"), (self._stat, "stat")):
                for pid in alive - set(fds):
                    fd = _open(f"/proc/{pid}/{name}")  # no /proc (macOS) or already gone: psutil is the fallback
                    if fd is not None:
                        fds[pid] = fd
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

    def _system_cpu(self) -> float:
        if self._proc_stat is None:
            return psutil.cpu_percent(interval=None)
        # first line: cpu user nice system idle iowait irq softirq steal guest guest_nice (guest time is already
        # inside user and nice, so it is left out of the total, as psutil does); idle and iowait are not busy
        fields = [int(x) for x in os.pread(self._proc_stat, 256, 0).split(b"\n", 1)[0].split()[1:9]]
        total, busy = sum(fields), sum(fields) - fields[3] - fields[4]
        last, self._last_system = self._last_system, (busy, total)
        if last is None or total <= last[1]:
            return 0.0
        return min(100.0, max(0.0, 100.0 * (busy - last[0]) / (total - last[1])))

    def read_cpu(self) -> list[float]:
        system = self._system_cpu()
        total = 0.0
        stat = self._stat
        for proc in self._processes():
            fd = stat.get(proc.pid)
            try:
                if fd is not None:
                    # fields after the ")" of the command name: utime stime cutime cstime are the 12th-15th
                    f = os.pread(fd, 1024, 0).rsplit(b")", 1)[1].split()
                    total += (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / CLOCK_TICKS
                    continue
                t = proc.cpu_times()
            except ProcessLookupError:
                if proc.pid == self.pid:
                    raise psutil.NoSuchProcess(proc.pid) from None
                continue
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
