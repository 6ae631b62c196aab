"""Atomic checkpoint directories: write into a temporary directory, manifest of SHA-256 last, then rename.

A checkpoint is ``<run_dir>/checkpoints/step_<N>/`` holding ``model.safetensors`` (consolidated fp32 weights),
engine state, one ``rank<r>.pt`` per rank (RNG states, loader state) and ``manifest.json``. A directory without a
manifest, or whose files do not match it, is incomplete: a kill at any moment leaves the previous one intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-step_"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """Create (afresh) the temporary directory a checkpoint for ``step`` is written into (rank 0 only)."""
    tmp = checkpoints_dir(run_dir) / f"{_TMP_PREFIX}{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_checkpoint(tmp: Path, step: int, meta: dict[str, Any] | None = None) -> Path:
    """Hash every file, write the manifest last, fsync, and rename into place (rank 0 only)."""
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        files[str(path.relative_to(tmp))] = sha256_file(path)
    manifest = {"step": step, "files": files, **(meta or {})}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = tmp.parent / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dir_fd = os.open(tmp.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def verify_checkpoint(path: str | Path, *, hashes: bool = True) -> str | None:
    """None when ``path`` is a complete checkpoint, else the reason it is not."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save was interrupted)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        return f"unreadable manifest: {exc}"
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if hashes and sha256_file(f) != digest:
            return f"SHA-256 mismatch in {rel}"
    return None


def find_resumable(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint and the (path, reason) of every newer or temporary one it skipped."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None, []
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and (p.name.startswith(_PREFIX) or p.name.startswith(_TMP_PREFIX))),
        key=lambda p: (int(p.name.rsplit("_", 1)[1]), p.name.startswith(_PREFIX)),
        reverse=True,
    )
    skipped: list[tuple[Path, str]] = []
    for p in candidates:
        if p.name.startswith(_TMP_PREFIX):
            skipped.append((p, "temporary directory of an interrupted save"))
            continue
        reason = verify_checkpoint(p)
        if reason is None:
            return p, skipped
        skipped.append((p, reason))
    return None, skipped


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir`` (manifest present, hashes match), or None.

    Example:
        >>> latest_checkpoint("runs/demo")  # doctest: +SKIP
        PosixPath('runs/demo/checkpoints/step_00001000')
    """
    return find_resumable(run_dir)[0]


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and any stale temporary directory."""
    root = checkpoints_dir(run_dir)
    done = sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / MANIFEST).is_file())
    removed = done[:-keep_last] if keep_last < len(done) else []
    removed += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def save_model_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Consolidated weights, floating tensors in fp32 (integer buffers keep their dtype); clones break tied
    storage, which safetensors refuses to write."""
    out = {}
    for k, v in state.items():
        v = v.detach().to("cpu")
        out[k] = (v.float() if v.is_floating_point() else v).contiguous().clone()
    save_file(out, str(path))


def load_model_weights(checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The consolidated fp32 model of a checkpoint, on ``device``; loads with any number of processes.

    Example:
        >>> model.load_state_dict(load_model_weights(latest_checkpoint("runs/demo")))  # doctest: +SKIP
    """
    path = Path(checkpoint_dir) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no consolidated model in this checkpoint")
    return load_file(str(path), device=str(device))


def rng_state() -> dict[str, Any]:
    """Every RNG the loop touches: python, numpy, torch CPU and (when present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_torch(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_torch(path: Path, device: str | torch.device = "cpu") -> Any:
    # Our own files hold numpy RNG states and plain Python objects, which weights_only=True rejects.
    return torch.load(path, map_location=device, weights_only=False)
