"""100 Hz GPU monitoring through NVML, as a library and as a command that replaces `watch nvidia-smi`.

Example:
    >>> import gpumon
    >>> with gpumon.Monitor(rate_hz=100, out="run/gpu.csv") as mon:
    ...     mon.mark("step", 0)
    >>> print(mon.summary())
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
