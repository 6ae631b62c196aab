"""Whether this machine has a real NVIDIA driver: the one check every gpumon test module shares."""

from gpumon.nvml_devices import NVMLUnavailable, load_nvml


def driver_present() -> bool:
    try:
        nvml = load_nvml()
    except NVMLUnavailable:
        return False
    nvml.nvmlShutdown()
    return True
