"""Finding the GPUs this process may use: NVML start-up, CUDA_VISIBLE_DEVICES, `devices()`.

The NVML binding is NVIDIA's `nvidia-ml-py` distribution, which provides the `pynvml` module (the PyPI
distribution named `pynvml` is a deprecated shim and is never required). The module is imported lazily so that a
test can put a fake `pynvml` into `sys.modules` first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any


class NVMLUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, no library, no visible GPU); the message is one line saying why."""


@dataclass(frozen=True)
class VisibleDevice:
    """One GPU as this process sees it: `index` is the CUDA ordinal, `nvml_index` NVML's own numbering."""

    index: int
    nvml_index: int
    uuid: str
    handle: Any


def load_nvml() -> ModuleType:
    """Import `pynvml` and initialise NVML, or raise NVMLUnavailable with a one-line reason.

    Every successful call must be paired with `module.nvmlShutdown()` (NVML counts initialisations).
    """
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared, but a broken environment should still read well
        raise NVMLUnavailable(f"the pynvml module (distribution nvidia-ml-py) cannot be imported: {exc}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NVMLUnavailable(f"NVML could not be initialised ({_text(exc)}): no usable NVIDIA driver here") from None
    except OSError as exc:
        raise NVMLUnavailable(f"the NVML library could not be loaded: {exc}") from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_visible(spec: str) -> list[str]:
    # CUDA stops at the first entry it cannot parse and ignores the rest ("0,bad,1" shows only GPU 0).
    entries = []
    for raw in spec.split(","):
        entry = raw.strip()
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    return entries


def visible_devices(nvml: ModuleType) -> list[VisibleDevice]:
    """The GPUs CUDA would show this process, in CUDA order, honouring CUDA_VISIBLE_DEVICES.

    Integer entries are NVML indices (CUDA numbers GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML
    by PCI bus: set CUDA_DEVICE_ORDER=PCI_BUS_ID for the two to agree); `GPU-...`/`MIG-...` entries are UUIDs or
    unique UUID prefixes, as CUDA accepts them.

    Example (two simulated GPUs from `gpumon.fake_nvml`; CUDA_VISIBLE_DEVICES lists them in reverse):
        >>> import os
        >>> from unittest import mock
        >>> from gpumon.fake_nvml import simulated_gpus
        >>> with simulated_gpus(), mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES="1,GPU-0000"):
        ...     nvml = load_nvml()
        ...     [(d.index, d.nvml_index, d.uuid[:12]) for d in visible_devices(nvml)]
        ...     nvml.nvmlShutdown()
        [(0, 1, 'GPU-99999999'), (1, 0, 'GPU-00000000')]
    """
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        order = list(range(count))
    else:
        order = []
        for entry in _parse_visible(spec):
            if entry.isdigit():
                found = int(entry) if int(entry) < count else None
            else:
                matches = [i for i, u in enumerate(uuids) if u.startswith(entry)]
                found = matches[0] if len(matches) == 1 else None
            if found is None or found in order:
                break  # CUDA treats an unknown or repeated device as the end of the list
            order.append(found)
    return [VisibleDevice(index=k, nvml_index=i, uuid=uuids[i], handle=handles[i]) for k, i in enumerate(order)]


def describe(nvml: ModuleType, device: VisibleDevice) -> dict[str, Any]:
    """Static facts about one GPU: name, memory_total (bytes), compute capability, uuid, indices, power limit."""
    handle = device.handle
    info: dict[str, Any] = {
        "index": device.index,
        "nvml_index": device.nvml_index,
        "uuid": device.uuid,
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "memory_total": int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
    }
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        info["compute_capability"] = f"{major}.{minor}"
    except nvml.NVMLError:
        info["compute_capability"] = None
    try:
        info["power_limit_w"] = nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0
    except nvml.NVMLError:
        info["power_limit_w"] = None
    return info


def devices() -> list[dict[str, Any]]:
    """Describe every GPU visible to this process, or raise NVMLUnavailable with a one-line reason.

    Each dict has index (CUDA ordinal), nvml_index, uuid, name, memory_total (bytes), compute_capability
    (e.g. "9.0") and power_limit_w (None where NVML does not report them).

    Example (the two simulated GPUs of `gpumon.fake_nvml`, then a simulated host without a driver):
        >>> import gpumon
        >>> from gpumon.fake_nvml import simulated_gpus
        >>> def show_gpus():
        ...     try:
        ...         for gpu in gpumon.devices():
        ...             print(gpu["index"], gpu["name"], gpu["memory_total"] / 2**30, "GiB", gpu["compute_capability"])
        ...     except gpumon.NVMLUnavailable as exc:
        ...         print("no GPU:", exc)
        >>> with simulated_gpus():
        ...     show_gpus()
        0 Fake GPU 0 80.0 GiB 9.0
        1 Fake GPU 1 80.0 GiB 9.0
        >>> with simulated_gpus() as fake:
        ...     fake.driver = False
        ...     show_gpus()
        no GPU: NVML could not be initialised (NVML Shared Library Not Found): no usable NVIDIA driver here
    """
    nvml = load_nvml()
    try:
        return [describe(nvml, d) for d in visible_devices(nvml)]
    except nvml.NVMLError as exc:
        raise NVMLUnavailable(f"NVML failed while listing GPUs: {_text(exc)}") from None
    finally:
        nvml.nvmlShutdown()
