"""A subprocess whose output lines a thread collects, so a test can wait for one line without blocking on the pipe,
and that is killed with every process under it (torchrun's workers run in sessions of their own)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time

import psutil
from launch import env


class Watched:
    def __init__(self, cmd: list[str]) -> None:
        # stdout and stderr apart: C++ code (gloo, torch) writes its warnings to stderr in several pieces, which on a
        # shared pipe can land in the middle of a line that the Python side wrote whole.
        self.proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []  # stdout
        self.err_lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._err_reader = threading.Thread(target=lambda: self.err_lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        self._err_reader.start()

    def wait_for(self, needle: str, timeout: float = 240, *, start: bool = False) -> str:
        """The first line holding ``needle`` (beginning with it when ``start``); kills the tree if none comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((ln for ln in list(self.lines) if (ln.startswith(needle) if start else needle in ln)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"never saw {needle!r}:\n{self.output()[-4000:]}")

    def finish(self, timeout: float) -> int:
        """The exit status; kills the tree and fails if the process is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._reader.join(timeout=10)
            raise AssertionError(f"still running {timeout} s later:\n{self.output()[-4000:]}") from None
        self._reader.join(timeout=30)
        self._err_reader.join(timeout=30)
        return code

    def kill(self) -> None:
        """SIGKILL the process and every process under it."""
        try:
            procs = [*psutil.Process(self.proc.pid).children(recursive=True), psutil.Process(self.proc.pid)]
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.proc.wait()

    def output(self) -> str:
        """stdout, then stderr."""
        return "".join(self.lines) + "".join(self.err_lines)
