"""Monitor end to end in its background thread: the fake NVML for GPUs, the real host backend."""

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

import gpumon
from gpumon.fake_nvml import FakeNVML, two_gpus
from gpumon.host_backend import HostBackend
from gpumon.recording import Recording


class ManualClock:
    """The simulated GPUs' clock: it moves only when a test moves it, so what they report never depends on how fast
    a (possibly loaded) machine runs the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(condition, what: str, timeout: float = 300.0) -> None:
    """Poll `condition` until it holds; the bound is for a stuck thread, far above what a loaded machine needs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


@pytest.fixture
def fake(monkeypatch):
    module = FakeNVML(two_gpus(lost_at=0.15, unsupported={"power_instant"}), clock=ManualClock())
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def test_monitor_records_marks_and_survives_a_lost_gpu(fake, tmp_path):
    out = tmp_path / "run" / "gpu.csv"
    with gpumon.Monitor(rate_hz=100, out=out) as mon:
        for step in range(3):
            mon.mark("step", step)
            time.sleep(0.01)
        wait_until(lambda: mon.summary().samples >= 5, "5 samples of both GPUs")
        fake.clock.now = 1.0  # past gpu1's lost_at
        wait_until(lambda: mon.summary().lost == ["gpu1"], "gpu1 reported lost")
        after_loss = mon.summary().samples
        for step in range(3, 6):
            mon.mark("step", step)
            time.sleep(0.01)
        wait_until(lambda: mon.summary().samples >= after_loss + 5, "5 samples after the loss")
        mon.mark("phase", "eval")
    summary = mon.summary()
    assert summary.lost == ["gpu1"] and "gpu1.power_instant_mw" in summary.unsupported
    assert summary.samples >= after_loss + 5  # the thread kept sampling after the loss
    assert summary.metrics["gpu0.memory_used_bytes"]["reads"] > summary.metrics["gpu1.memory_used_bytes"]["reads"]
    assert summary.marks == 7 and summary.sampler_us_per_sample > 0 and summary.sampler_cpu_percent >= 0
    assert fake.init_count == 0
    rec = Recording(out)
    assert rec.meta["backends"] == ["nvml", "host"] and rec.trailer is not None
    assert [(label, value) for _, label, value in rec.marks()] == [("step", str(i)) for i in range(6)] + [
        ("phase", "eval")
    ]
    times = [t for t, _, _ in rec.marks()]
    assert times == sorted(times)
    file_summary = gpumon.summarize_recording(out)
    assert file_summary.samples == summary.samples and file_summary.lost == ["gpu1"]
    assert file_summary.metrics["gpu0.temperature_c"]["peak"] == summary.metrics["gpu0.temperature_c"]["peak"]


def test_auto_falls_back_to_host_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=False))
    with pytest.warns(UserWarning, match="monitoring the host only"), gpumon.Monitor(rate_hz=50) as mon:
        time.sleep(0.05)
    assert mon.fallback_reason and all(c.startswith("host.") for c in mon.columns)


def test_nvml_backend_without_driver_raises_at_the_boundary(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=False))
    mon = gpumon.Monitor(backend="nvml")
    with pytest.raises(gpumon.NVMLUnavailable):
        mon.start()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"backend": "cuda"}, "backend"), ({"rate_hz": 0}, "rate_hz"), ({"periods": {"memroy": 0.1}}, "periods")],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gpumon.Monitor(**kwargs)


@pytest.mark.parametrize(("periods", "field"), [({"memory": None}, "memory"), ({"host.cpu": None}, "cpu")])
def test_a_period_of_none_is_for_utilization_only(fake, periods, field):
    # None stands for the device's own refresh window, which only utilization has; elsewhere it used to reach
    # Poller and fail there with a TypeError
    mon = gpumon.Monitor(rate_hz=100, periods=periods)
    try:
        with pytest.raises(ValueError, match=rf"periods\['{field}'\] must be >= 0 seconds, got None"):
            mon.start()
    finally:
        mon.stop()


def test_mark_and_stop_never_raise():
    mon = gpumon.Monitor(backend="host")
    mon.mark("before start", object())
    mon.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon = gpumon.Monitor(backend="host", rate_hz=200).start()
    mon.mark("odd value", {"a": [1, 2]})
    mon.stop()
    mon.stop()
    assert mon.summary().marks == 1


def test_host_backend_follows_a_real_process_tree(tmp_path):
    # a parent that starts a child holding 64 MiB: the tree's RSS must include the child's memory
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import time; x = bytearray(64 << 20); x[::4096] = bytes(len(x[::4096])); time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        backend = HostBackend(pid=parent.pid)
        # On a busy machine the two interpreters may need a long while to start and touch their pages.
        deadline = time.monotonic() + 300
        rss, processes = backend.read_memory()
        while (processes < 2 or rss <= 64 * 2**20) and time.monotonic() < deadline:
            time.sleep(0.05)
            backend.close()  # the tree is re-listed at most once a second; a new backend lists it now
            backend = HostBackend(pid=parent.pid)
            rss, processes = backend.read_memory()
        backend.read_cpu()
        time.sleep(0.1)
        system_cpu, tree_cpu = backend.read_cpu()
        backend.close()
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and the child it started
        parent.wait()
    assert processes == 2
    assert rss > 64 * 2**20
    assert 0.0 <= system_cpu <= 100.0 and tree_cpu >= 0.0


def test_host_backend_reports_the_root_process_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    backend = HostBackend(pid=proc.pid)
    proc.wait()
    time.sleep(0.05)
    with pytest.raises(Exception) as info:
        backend.read_memory()
    assert backend.classify(info.value) == "lost"


@pytest.mark.gpu
def test_real_nvml_monitor_records_every_visible_gpu(tmp_path):
    with gpumon.Monitor(rate_hz=100, out=tmp_path / "g.csv", backend="nvml") as mon:
        time.sleep(0.5)
    summary = mon.summary()
    assert summary.samples > 10 and not summary.lost
    for gpu in gpumon.devices():
        assert summary.metrics[f"gpu{gpu['index']}.memory_used_bytes"]["reads"] > 10


def test_blocking_calls_run_off_the_fast_thread(fake, tmp_path):
    # NVML's PCIe throughput call waits for its 20 ms window: it must not hold up the 100 Hz ticks
    threads = set()
    original = fake.nvmlDeviceGetPcieThroughput

    def slow_pcie(handle, counter):
        threads.add(threading.current_thread().name)
        time.sleep(0.02)
        return original(handle, counter)

    fake.nvmlDeviceGetPcieThroughput = slow_pcie
    fake.gpus[1].lost_at = None
    with gpumon.Monitor(rate_hz=100, out=tmp_path / "g.csv", periods={"pcie": 0.1}) as mon:
        wait_until(lambda: mon.summary().metrics.get("gpu0.pcie_tx_kbps", {}).get("reads", 0) >= 2, "2 PCIe readings")
    assert threads == {"gpumon-sampler-slow"}
    reads = mon.summary().metrics["gpu0.pcie_tx_kbps"]["reads"]
    assert reads >= 2  # the readings made it into the statistics (and the file, checked next)
    rec = Recording(tmp_path / "g.csv")
    i = rec.columns.index("gpu0.pcie_tx_kbps")
    assert sum(1 for _, kind, _, _, cells in rec.rows() if kind == "s" and cells[i]) == reads


def test_host_metrics_are_polled_at_their_own_period(tmp_path):
    from gpumon.sampler import Sampler

    backend = HostBackend()
    assert backend.periods == {"cpu": 0.1, "memory": 0.1}
    sampler = Sampler(backend.pollers, rate_hz=100, out=tmp_path / "h.csv", clock=lambda: 0.0)
    for k in range(100):  # one second of ticks on a manual clock
        sampler.sample_once(k / 100)
    sampler.stop()
    backend.close()
    summary = sampler.summary()
    assert summary.metrics["host.tree_rss_bytes"]["reads"] == 10
    assert summary.metrics["host.cpu_pct"]["reads"] == 10
    # an override still reads every tick
    fast = HostBackend(periods={"memory": 0.0})
    sampler = Sampler(fast.pollers, rate_hz=100, clock=lambda: 0.0)
    for k in range(20):
        sampler.sample_once(k / 100)
    fast.close()
    assert sampler.summary().metrics["host.tree_processes"]["reads"] == 20


def test_host_cpu_from_proc_matches_the_process_own_accounting():
    from gpumon.host_backend import proc_children

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        children = proc_children(os.getpid())
        if children is None:
            pytest.skip("no /proc/<pid>/task/<tid>/children on this system (the psutil fallback is used)")
        assert child.pid in children
    finally:
        child.kill()
        child.wait()
    backend = HostBackend()
    backend.read_cpu()
    first = backend._last_cpu_wall  # the backend's own window, so that a pause on a loaded machine cannot skew it
    before = os.times()
    c0 = time.process_time()
    x = 0
    while time.process_time() - c0 < 1.0:  # busy: one CPU second, however long a loaded machine takes to give it
        x += 1
    system_cpu, tree_cpu = backend.read_cpu()
    after = os.times()
    window = backend._last_cpu_wall - first
    backend.close()
    own = 100 * (after.user + after.system - before.user - before.system) / window
    assert 0.0 < system_cpu <= 100.0
    assert tree_cpu == pytest.approx(own, abs=5.0)  # both count in 10 ms ticks: 2 ticks of a >= 1 s window


def test_thread_batches_reads_yet_latest_and_the_file_miss_nothing(tmp_path):
    from gpumon.pollers import Poller
    from gpumon.sampler import BATCH_S, Sampler

    reads = []

    def read():
        reads.append(len(reads))
        return [reads[-1]]

    sampler = Sampler([Poller("n", "n", ["n.count"], ["count"], 0.0, read)], rate_hz=200, out=tmp_path / "n.csv")
    sampler.start()
    wait_until(lambda: len(reads) >= 5, "5 reads")
    sampler.mark("early")
    # raw reads wait for their batch, but latest() already shows the newest of them
    assert sampler.latest()["n.count"] >= 4
    time.sleep(2 * BATCH_S)
    sampler.mark("late", 1)
    sampler.stop()
    rec = Recording(tmp_path / "n.csv")
    rows = list(rec.rows())
    samples = [int(cells[0]) for _, kind, _, _, cells in rows if kind == "s"]
    assert samples == list(range(len(reads)))  # every read, once, in order, each a fresh value
    times = [t for t, *_ in rows]
    assert times == sorted(times)  # marks sit between the samples they fall between
    assert [label for _, kind, label, _, _ in rows if kind == "mark"] == ["early", "late"]
    assert sampler.summary().samples == len(reads)
