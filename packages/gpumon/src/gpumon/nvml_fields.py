"""NVML field values: a tick's power and energy readings in one nvmlDeviceGetFieldValues call.

NVML has field ids for instant power (186), power averaged over 1 s (185) and the energy counter (191, and the
older 83, the same counter under its former name); it has none for memory used, the SM or memory clock, the GPU
temperature or the current clock-event bitmask, so those stay one call each.

Where the driver lacks a field (a status of NOT_SUPPORTED or INVALID_ARGUMENT, or no field-values entry point at
all), a stand-in is chosen once, at start, from one probe call per field:
- energy: field 83 in the same call, else nvmlDeviceGetTotalEnergyConsumption (the same counter, in mJ);
- nvmlDeviceGetPowerUsage returns the power averaged over 1 s on Ampere GPUs other than GA100 and on newer ones
  (compute capability 8.6 and up), and instantaneous power on GA100 and older (NVML's stated behaviour, not yet
  compared with the fields on a driver here): it stands in for the
  average on the former and for instant power on the latter, one call per tick.
A column with no working source keeps its field: it fails once at the first tick and is dropped as unsupported.
`sources` says where each column comes from; the backend puts it into the recording's header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# NVML's field ids; older bindings may lack the names
POWER_AVERAGE, POWER_INSTANT, ENERGY, TOTAL_ENERGY_CONSUMPTION = 185, 186, 191, 83
VALUE_ATTRS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}  # NVML_VALUE_TYPE_*
MISSING_CODES = {"NVML_ERROR_NOT_SUPPORTED": 3, "NVML_ERROR_INVALID_ARGUMENT": 2, "NVML_ERROR_FUNCTION_NOT_FOUND": 13}


@dataclass(frozen=True)
class FieldColumn:
    """One column read through field values: candidate field ids (preferred first) and a per-call stand-in."""

    column: str
    fields: tuple[int, ...]
    call: Callable[[Any], Any] | None = None  # takes the device handle
    call_name: str = ""


def power_columns(nvml: ModuleType, group: str, compute_capability: str | None) -> list[FieldColumn]:
    """The power and energy columns of one GPU, with the stand-ins its architecture allows."""
    instant_call = average_call = None
    if compute_capability:
        major, _, minor = compute_capability.partition(".")
        averaged = (int(major), int(minor or 0)) >= (8, 6)  # nvmlDeviceGetPowerUsage: see the module docstring
        usage = "nvmlDeviceGetPowerUsage"
        instant_call, average_call = (None, usage) if averaged else (usage, None)

    def call(name: str | None) -> tuple[Callable[[Any], Any] | None, str]:
        if not name:
            return None, ""
        fn = getattr(nvml, name, None)
        return (fn, name) if fn is not None else (None, "")

    return [
        FieldColumn(f"{group}.power_instant_mw", (_id(nvml, "POWER_INSTANT", POWER_INSTANT),), *call(instant_call)),
        FieldColumn(f"{group}.power_average_mw", (_id(nvml, "POWER_AVERAGE", POWER_AVERAGE),), *call(average_call)),
        FieldColumn(
            f"{group}.energy_mj",
            (_id(nvml, "ENERGY", ENERGY), _id(nvml, "TOTAL_ENERGY_CONSUMPTION", TOTAL_ENERGY_CONSUMPTION)),
            *call("nvmlDeviceGetTotalEnergyConsumption"),
        ),
    ]


def _id(nvml: ModuleType, name: str, value: int) -> int:
    return int(getattr(nvml, f"NVML_FI_DEV_{name}", value))


def decode_field(nvml: ModuleType, fv: Any) -> Any:
    """One c_nvmlFieldValue_t: its value by valueType, or the NVMLError its status names."""
    status = int(fv.nvmlReturn)
    if status != 0:  # NVML_SUCCESS
        return nvml.NVMLError(status)
    kind = int(fv.valueType)
    value = getattr(fv.value, VALUE_ATTRS.get(kind, "ullVal"))
    return float(value) if kind == 0 else int(value)


class FieldReader:
    """Reads `columns` of the device `handle`: field values in one call, stand-ins by their own calls.

    Example (a simulated GPU from `gpumon.fake_nvml` whose driver predates field 191, on a clock stopped at 0):
        >>> from gpumon.fake_nvml import FakeGPU, FakeNVML
        >>> nvml = FakeNVML([FakeGPU("Fake GPU 0", "GPU-0", unknown_fields={191})], clock=lambda: 0.0)
        >>> nvml.nvmlInit()
        >>> reader = FieldReader(nvml, nvml.nvmlDeviceGetHandleByIndex(0), power_columns(nvml, "gpu0", "9.0"))
        >>> reader.sources
        {'gpu0.power_instant_mw': 'field 186', 'gpu0.power_average_mw': 'field 185', 'gpu0.energy_mj': 'field 83'}
        >>> reader.read()  # mW, mW, mJ
        [250000, 250000, 0]
        >>> nvml.nvmlShutdown()
    """

    def __init__(self, nvml: ModuleType, handle: Any, columns: Sequence[FieldColumn]) -> None:
        self.nvml, self.handle = nvml, handle
        self.columns = [c.column for c in columns]
        self.sources: dict[str, str] = {}
        self._fields: list[tuple[int, int]] = []  # (output position, field id): one call for all of them
        self._calls: list[tuple[int, Callable[[Any], Any]]] = []  # (output position, stand-in)
        probed = {f: self._probe_field(f) for c in columns for f in c.fields}
        missing = set(MISSING_CODES.values())
        for k, c in enumerate(columns):
            working = [f for f in c.fields if probed[f] == 0]
            if working:
                self._fields.append((k, working[0]))
                self.sources[c.column] = f"field {working[0]}"
            elif c.call is not None and all(probed[f] in missing for f in c.fields) and self._call_works(c.call):
                self._calls.append((k, c.call))
                self.sources[c.column] = c.call_name
            else:  # read as asked: the first tick reports why, and the sampler drops or retries it
                self._fields.append((k, c.fields[0]))
                self.sources[c.column] = f"field {c.fields[0]}"
        self._ids = [f for _, f in self._fields]

    def _probe_field(self, field: int) -> int:
        # one field per call, so that a driver that refuses a whole request for one id it does not know cannot
        # hide the others; the status code, 0 when the field can be read
        try:
            (fv,) = self.nvml.nvmlDeviceGetFieldValues(self.handle, [field])
            return int(fv.nvmlReturn)
        except self.nvml.NVMLError as exc:
            return int(getattr(exc, "value", -1))
        except AttributeError:  # a binding without nvmlDeviceGetFieldValues
            return MISSING_CODES["NVML_ERROR_FUNCTION_NOT_FOUND"]

    def _call_works(self, call: Callable[[Any], Any]) -> bool:
        try:
            call(self.handle)
        except Exception:
            return False
        return True

    def read(self) -> list[Any]:
        """One value per column (an NVMLError instance where that field failed; None once a column is dropped)."""
        nvml = self.nvml
        out: list[Any] = [None] * len(self.columns)
        if self._ids:
            try:
                values = nvml.nvmlDeviceGetFieldValues(self.handle, self._ids)
            except Exception as exc:  # the call as a whole: every field in it failed, the stand-ins still run
                for k, _ in self._fields:
                    out[k] = exc
            else:
                for (k, _), fv in zip(self._fields, values, strict=True):
                    out[k] = decode_field(nvml, fv)
        for k, call in self._calls:
            try:
                out[k] = int(call(self.handle))
            except Exception as exc:  # this column only; the fields read above stand
                out[k] = exc
        return out

    def drop(self, column: str) -> None:
        """Stop asking for `column` (it failed as unsupported)."""
        k = self.columns.index(column)
        self._fields = [(j, f) for j, f in self._fields if j != k]
        self._calls = [(j, c) for j, c in self._calls if j != k]
        self._ids = [f for _, f in self._fields]
