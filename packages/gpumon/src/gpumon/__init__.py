"""100 Hz GPU monitoring through NVML, as a library and as a command that replaces `watch nvidia-smi`.

Example (`simulated_gpus()` puts two simulated GPUs where a driver would be; on a GPU host leave it out):
    >>> import time
    >>> import gpumon
    >>> from gpumon.fake_nvml import simulated_gpus
    >>> with simulated_gpus():
    ...     [gpu["name"] for gpu in gpumon.devices()]
    ...     with gpumon.Monitor(rate_hz=100) as mon:  # no `out` file: the statistics only
    ...         time.sleep(0.05)  # a training step
    ['Fake GPU 0', 'Fake GPU 1']
    >>> print(mon.summary())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    gpumon: ... samples, achieved ... Hz (target 100), p99 interval error ... ms, ... missed ticks
    sampler cost: ...
    metric unit peak mean p50 p95 p99 last fresh errors
    gpu0.memory_used_bytes GiB ...
    gpu1.memory_used_bytes GiB ...
"""

from gpumon.host_backend import HostBackend
from gpumon.monitor import Monitor
from gpumon.nvml_backend import NVMLBackend
from gpumon.nvml_devices import NVMLUnavailable, devices
from gpumon.recording import Recording, RecordingError, RecordingExistsError, host_name, recording_path
from gpumon.reports import summarize_recording
from gpumon.sampler import Sampler
from gpumon.statistics import Summary
from gpumon.version import __version__

__all__ = [
    "HostBackend",
    "Monitor",
    "NVMLBackend",
    "NVMLUnavailable",
    "Recording",
    "RecordingError",
    "RecordingExistsError",
    "Sampler",
    "Summary",
    "__version__",
    "devices",
    "host_name",
    "recording_path",
    "summarize_recording",
]
