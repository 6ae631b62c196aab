"""The CPU choices a run computes with (threads, the library of the fp32 GEMMs, bf16 autocast): made once, kept.

A probe times the alternatives and picks the faster; on a loaded machine its answer flips from one process to the
next, and each answer computes different bits. So a choice, once made, is kept: a run records what it computed with
(run.json: ``cpu_threads``, ``cpu_matmul``, the precision of its ``train_config``) and a resumed run, or a run started
``--init-from`` it, computes with the same; a fresh run takes the machine's earlier answer for the same model shapes
from the probe cache (:class:`ProbeCache`, a JSON file under ``~/.cache/lmtrain``, or ``$LMTRAIN_PROBE_CACHE``),
and probes only where there is none. Identical commands on one machine then compute with identical settings whatever
the load. The user's own settings (``--set cpu_threads=N``, ``OMP_NUM_THREADS``, ``--set cpu_matmul_probe=false``,
``--set precision=...``) come first and are never cached.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path
from typing import Any

CACHE_ENV = "LMTRAIN_PROBE_CACHE"
KINDS = ("threads", "precision", "matmul", "inference threads")


def cache_path() -> Path:
    """Where the machine's probe answers live: ``$LMTRAIN_PROBE_CACHE``, else ``$XDG_CACHE_HOME/lmtrain/probes.json``
    (``~/.cache`` without it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lmtrain" / "probes.json"


def machine() -> str:
    """This machine as the cache knows it: the CPU model, the cores, the torch build (an answer holds for these)."""
    import torch

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    return f"{name} | {os.cpu_count()} cores | torch {torch.__version__}"


def shapes(model: Any, micro_batch: int, seq_len: int, **more: Any) -> str:
    """The key of a model's step for the cache: the sizes that decide what a step computes, and ``more``."""
    fields = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "norm", "activation", "bias",
              "tie_embeddings", "checkpointing", "document_separator")  # fmt: skip
    values = {f: getattr(model, f, None) for f in fields}
    return json.dumps({**values, "micro_batch": micro_batch, "seq_len": seq_len, **more}, sort_keys=True)


class ProbeCache:
    """The machine's earlier probe answers, by kind (threads, precision, matmul) and model shapes.

    Reading a missing or broken file gives no answers; a file that cannot be written (a read-only home) is left as it
    is: the cache only saves probing again.

    Example:
        >>> import tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> cache = ProbeCache(Path(work.name) / "probes.json")
        >>> cache.get("threads", "k") is None
        True
        >>> cache.put("threads", "k", 1)
        >>> ProbeCache(Path(work.name) / "probes.json").get("threads", "k")
        1
        >>> work.cleanup()
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else cache_path()
        self.machine = machine()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, kind: str, key: str) -> Any:
        """The answer recorded for ``kind`` at ``key`` on this machine, or None."""
        mine = self._read().get(self.machine)
        return mine.get(f"{kind} {key}") if isinstance(mine, dict) else None

    def put(self, kind: str, key: str, value: Any) -> None:
        """Record ``value`` for ``kind`` at ``key`` on this machine (an earlier answer is kept: the first one wins)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
        data = self._read()
        mine = data.setdefault(self.machine, {})
        if not isinstance(mine, dict) or f"{kind} {key}" in mine:
            return
        mine[f"{kind} {key}"] = value
        with contextlib.suppress(OSError):
            from lmtrain.json_files import write_json_atomic

            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, data)


def set_matmul_library(
    model: Any, tokens: int, *, enabled: bool, recorded: str | None, cache: ProbeCache | None
) -> tuple[str, str]:
    """Route this process's fp32 GEMMs (lmcore.route_cpu_matmuls) and say how it was decided: (library, line).

    ``enabled`` False (``--set cpu_matmul_probe=false``) keeps MKL unmeasured; else the ``recorded`` library of a
    resumed or source run, else the machine's cached answer for these shapes, else a probe (cached afterwards).
    """
    import torch

    import lmcore
    from lmcore.cpu_math import set_cpu_matmul_library

    if not enabled:
        lmcore.route_cpu_matmuls(model, tokens, enabled=False)
        return "mkl", "fp32 GEMMs on MKL: the matmul probe is off (--set cpu_matmul_probe=false)"
    key = shapes(model, tokens, 1, threads=torch.get_num_threads())
    known = recorded or (cache.get("matmul", key) if cache is not None else None)
    if known in ("mkl", "onednn"):
        set_cpu_matmul_library(known)
        where = "as the run recorded" if recorded else f"as this machine's probe cache recorded ({cache_path()})"
        return known, f"fp32 GEMMs on {'oneDNN' if known == 'onednn' else 'MKL'}, {where}: not probed again"
    probe = lmcore.route_cpu_matmuls(model, tokens, enabled=True)
    library = "onednn" if probe.routed else "mkl"
    if cache is not None:
        cache.put("matmul", key, library)
    return library, f"fp32 GEMMs on {'oneDNN' if probe.routed else 'MKL'}: {probe.reason}"


def set_inference_matmuls(record: Any) -> str | None:
    """Send this process's fp32 GEMMs on a CPU where the run's recorded them (``record.cpu_matmul``: "mkl" or
    "onednn"), so that `eval` and `generate` compute as its training did; None (left as they are) for a run that
    recorded none (trained on a GPU, or before the record).

    Example:
        >>> from types import SimpleNamespace
        >>> set_inference_matmuls(SimpleNamespace(cpu_matmul="mkl"))
        'fp32 GEMMs on mkl, as the run trained with'
    """
    from lmcore.cpu_math import set_cpu_matmul_library
    from lmtrain.run_record import MATMUL_LIBRARIES

    if record.cpu_matmul not in MATMUL_LIBRARIES:
        return None
    set_cpu_matmul_library(record.cpu_matmul)
    return f"fp32 GEMMs on {record.cpu_matmul}, as the run trained with"


def set_inference_threads(model: Any, record: Any, *, cache: ProbeCache | None = None) -> str | None:
    """Set the CPU threads `eval` and `generate` run ``model`` with, and say how they were chosen (None: left as
    they are, under OMP_NUM_THREADS or in a job of several ranks). A run trained on a CPU recorded the count it
    trained with: that one (at most this machine's cores); else the machine's cached answer for these shapes, else
    a probe of a forward pass at one thread and at all cores (cached afterwards)."""
    import torch

    import lmcore

    if "OMP_NUM_THREADS" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    cores = os.cpu_count() or 1
    if record.cpu_matmul is not None and isinstance(record.cpu_threads, int) and record.cpu_threads >= 1:
        threads = min(record.cpu_threads, cores)
        torch.set_num_threads(threads)
        return f"{threads} CPU thread(s), as the run trained with"
    key = shapes(model.config, 1, model.config.context_length)
    known = cache.get("inference threads", key) if cache is not None else None
    if isinstance(known, int) and 1 <= known <= cores:
        torch.set_num_threads(known)
        return f"{known} CPU thread(s), as this machine's probe cache recorded ({cache_path()})"
    ids = torch.randint(0, model.config.vocab_size, (1, model.config.context_length))

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    walls = {n: lmcore.time_step(forward, n, steps=2, warmup=1).wall_s for n in sorted({1, cores})}
    threads = min(walls, key=walls.__getitem__)
    if cache is not None:
        cache.put("inference threads", key, threads)
    torch.set_num_threads(threads)
    return f"{threads} CPU thread(s) (s/forward measured: " + ", ".join(f"{n}: {s:.3f}" for n, s in walls.items()) + ")"
