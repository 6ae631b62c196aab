"""Atomic checkpoint directories, owned by one object: :class:`CheckpointStore`.

A checkpoint is ``<run_dir>/checkpoints/step_<N>/`` holding the consolidated weights (``model.safetensors``, with
``config.json`` when the model saves itself), the engine's state, one ``rank<r>.pt`` per rank (RNG states, loader
state, schedule state) and ``manifest.json`` (size and SHA-256 of every file), written last before the directory
is renamed into place. A directory without a manifest, or whose files do not match it, is incomplete: a kill at
any moment leaves the previous checkpoint intact. ``checkpoints/best.json`` points at the checkpoint with the best
evaluation so far.

Every state file the toolkit itself writes loads with ``torch.load(weights_only=True)``: a checkpoint cannot run
code through them. DeepSpeed's own files (the ``deepspeed/`` subdirectory) are read the same way, with the few
DeepSpeed classes they hold allowed (trainloop.deepspeed_compat.safe_load). A run directory whose members link
outside it is refused (refuse_outside_links), and the files a run writes are never written through a link: a
symbolic link, a file with other hard links or a non-regular file in their place is refused (open_guarded,
refuse_linked) before anything is emptied or replaced.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
BEST_FILE = "best.json"
_STEP_RE = re.compile(r"step_(\d{8})")
_TMP_RE = re.compile(r"\.tmp-step_(\d{8})")
VERIFY_MODES = ("sizes", "full")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, not found, unsafe); the message names the path and the fix."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a well-formed ``manifest.json`` under ``path``, else (None, the reason it is not).

    Well-formed: a JSON object with an integer ``step`` and a non-empty ``files`` mapping of relative paths that
    stay inside the checkpoint to a SHA-256 hex digest or ``{"sha256": ..., "bytes": ...}``.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest (the save was interrupted)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return None, "malformed manifest (expected an object with a non-empty 'files' mapping)"
    if not isinstance(manifest.get("step"), int):
        return None, "malformed manifest (no integer 'step')"
    world = manifest.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return None, f"malformed manifest (world_size {world!r}: expected a number of ranks >= 1)"
    if not isinstance(manifest.get("engine", "torch"), str):
        return None, f"malformed manifest (engine {manifest['engine']!r}: expected a name such as 'torch')"
    root = path.resolve()
    for rel, entry in manifest["files"].items():
        inside = not os.path.isabs(rel) and ".." not in Path(rel).parts
        if not inside or not (root / rel).resolve().is_relative_to(root):
            return None, f"manifest entry {rel!r} points outside the checkpoint"
        digest = entry.get("sha256") if isinstance(entry, dict) else entry
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            return None, f"malformed manifest entry for {rel!r}"
    return manifest, None


def verify_checkpoint(path: str | Path, *, verify: str = "full") -> str | None:
    """None when ``path`` is a complete checkpoint, else the reason it is not.

    ``verify="sizes"`` checks the manifest and that every file is present with its recorded size (cheap: what
    resume and evaluation do by default); ``"full"`` also recomputes every SHA-256 (reads every byte).
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: allowed values are {', '.join(VERIFY_MODES)}")
    path = Path(path)
    manifest, reason = read_manifest(path)
    if manifest is None:
        return reason
    for rel, entry in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if size is not None and f.stat().st_size != size:
            return f"size mismatch in {rel} ({f.stat().st_size} bytes, manifest says {size})"
        digest = entry["sha256"] if isinstance(entry, dict) else entry
        if verify == "full" and sha256_file(f) != digest:
            return f"SHA-256 mismatch in {rel}"
    return None


class CheckpointStore:
    """The checkpoints of one run directory: their names, atomic writes, verification, choice and pruning.

    Example:
        >>> import tempfile
        >>> run = tempfile.TemporaryDirectory()
        >>> store = CheckpointStore(run.name)
        >>> store.step_dir(1000).name
        'step_00001000'
        >>> for step in (800, 1000):
        ...     tmp = store.begin(step)
        ...     _ = (tmp / "rank0.pt").write_bytes(b"state")  # what the ranks write
        ...     _ = store.finish(tmp, step)
        >>> store.mark_best(800, "eval_loss", 2.31)
        >>> [(path.name, notes) for path, notes in (store.resolve("best"), store.resolve("latest"))]
        [('step_00000800', []), ('step_00001000', [])]
        >>> _ = store.begin(1200)  # a save interrupted before finish()
        >>> path, notes = store.resolve("latest")
        >>> path.name
        'step_00001000'
        >>> notes
        ['skipped .tmp-step_00001200: temporary directory of an interrupted save', 'fell back to step_00001000']
        >>> run.cleanup()
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"

    # -------------------------------------------------------------------------------------------- names
    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".tmp-step_{step:08d}"

    @staticmethod
    def rank_file(ckpt: Path, rank: int) -> Path:
        return ckpt / f"rank{rank}.pt"

    def _scan(self) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
        """(step, path) of checkpoint directories and of temporary ones; names of any other shape are ignored."""
        done: list[tuple[int, Path]] = []
        tmp: list[tuple[int, Path]] = []
        if not self.root.is_dir():
            return done, tmp
        for p in self.root.iterdir():
            if not p.is_dir():
                continue
            if m := _STEP_RE.fullmatch(p.name):
                done.append((int(m.group(1)), p))
            elif m := _TMP_RE.fullmatch(p.name):
                tmp.append((int(m.group(1)), p))
        return sorted(done), sorted(tmp)

    def steps(self) -> list[int]:
        """Steps of every checkpoint directory present (complete or not), ascending."""
        return [s for s, _ in self._scan()[0]]

    # -------------------------------------------------------------------------------------------- writing
    def begin(self, step: int) -> Path:
        """Create (afresh) the temporary directory a checkpoint for ``step`` is written into (rank 0 only)."""
        tmp = self.tmp_dir(step)
        _remove(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def finish(self, tmp: Path, step: int, meta: dict[str, Any] | None = None) -> Path:
        """Hash every file, write the manifest last, fsync, and rename into place (rank 0 only).

        Every file gets the mode the umask gives a new file (0644 under umask 022): writers that go through a
        temporary file of their own (safetensors) create 0600. The mode is read off ``tmp``, which ``begin``
        created under the same umask, so the umask itself is never changed."""
        mode = stat.S_IMODE(tmp.stat().st_mode) & 0o666
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            path.chmod(mode)
            files[str(path.relative_to(tmp))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        manifest = {"step": step, "files": files, **(meta or {})}
        with open_new(tmp / MANIFEST) as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.step_dir(step)
        _remove(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final

    def mark_best(self, step: int, metric: str, value: float) -> None:
        """Point ``best.json`` at the checkpoint of ``step`` (which must exist), atomically (rank 0 only)."""
        data = {"step": step, "checkpoint": self.step_dir(step).name, "metric": metric, "value": value}
        tmp = self.root / f".{BEST_FILE}.tmp"
        refuse_linked(self.root / BEST_FILE)
        _remove(tmp)
        with open_new(tmp) as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.root / BEST_FILE)

    def best(self) -> dict[str, Any] | None:
        """The best-checkpoint record (``step``, ``checkpoint``, ``metric``, ``value``), or None without one."""
        try:
            data = json.loads((self.root / BEST_FILE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        ok = isinstance(data, dict) and isinstance(data.get("step"), int) and isinstance(data.get("value"), float)
        return data if ok else None

    def prune(self, keep_last: int, current_step: int) -> list[Path]:
        """Delete complete checkpoints older than the newest ``keep_last`` at or before ``current_step``, and stale
        temporary directories; never the best checkpoint and never one after ``current_step`` (rank 0 only)."""
        done, tmp = self._scan()
        best = self.best()
        best_step = best["step"] if best else None
        mine = [p for s, p in done if s <= current_step and s != best_step and (p / MANIFEST).is_file()]
        removed = mine[:-keep_last] if keep_last < len(mine) else []
        removed += [p for _, p in tmp]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def clear(self) -> None:
        """Delete every checkpoint and the best pointer (a run started over with ``--overwrite``)."""
        _remove(self.root)

    # -------------------------------------------------------------------------------------------- choosing
    def find_resumable(self, verify: str = "sizes") -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest complete checkpoint and the (path, reason) of every newer or temporary one it skipped."""
        done, tmp = self._scan()
        candidates = sorted([(s, 1, p) for s, p in done] + [(s, 0, p) for s, p in tmp], reverse=True)
        skipped: list[tuple[Path, str]] = []
        for _, complete_name, p in candidates:
            if not complete_name:
                skipped.append((p, "temporary directory of an interrupted save"))
                continue
            reason = verify_checkpoint(p, verify=verify)
            if reason is None:
                return p, skipped
            skipped.append((p, reason))
        return None, skipped

    def resolve(self, which: str | int = "latest", verify: str = "sizes") -> tuple[Path, list[str]]:
        """The checkpoint named by ``which`` and notes on what was skipped or fallen back from.

        ``which``: ``"latest"`` (newest complete), ``"best"`` (lowest evaluation loss; the latest when the run has
        no evaluation yet), a step number, or the path of a checkpoint directory. Raises CheckpointError when
        nothing usable matches.
        """
        notes: list[str] = []
        if which == "best":
            best = self.best()
            if best is not None:
                path = self.root / best["checkpoint"]
                reason = (
                    "outside the checkpoints directory"
                    if not _STEP_RE.fullmatch(str(best["checkpoint"]))
                    else verify_checkpoint(path, verify=verify)
                )
                if reason is None:
                    return path, notes
                notes.append(f"best checkpoint {best['checkpoint']} is unusable ({reason}); using the latest")
            else:
                notes.append("no evaluated best checkpoint in this run; using the latest")
            which = "latest"
        if which == "latest":
            path, skipped = self.find_resumable(verify)
            notes += [f"skipped {p.name}: {reason}" for p, reason in skipped]
            if path is None:
                raise CheckpointError(f"{self.root}: no complete checkpoint" + (f" ({'; '.join(notes)})" if notes
                                      else "") + "; train first or pick another run")  # fmt: skip
            if skipped:
                notes.append(f"fell back to {path.name}")
            return path, notes
        if isinstance(which, int) or (isinstance(which, str) and which.isdigit()):
            path = self.step_dir(int(which))
            if not path.is_dir():
                have = ", ".join(str(s) for s in self.steps()) or "none"
                raise CheckpointError(f"{self.root}: no checkpoint for step {int(which)} (steps present: {have})")
        else:
            path = Path(which)
            if not path.is_dir():
                raise CheckpointError(
                    f"checkpoint {which!r}: not 'latest', 'best', a step number or a checkpoint directory"
                )
        reason = verify_checkpoint(path, verify=verify)
        if reason is not None:
            raise CheckpointError(f"{path}: incomplete checkpoint ({reason}); pick another (`latest` or a step)")
        return path, notes


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory's (``step_00000020``), not a temporary one's or another file's."""
    return _STEP_RE.fullmatch(name) is not None


def _remove(path: Path) -> None:
    """Delete ``path`` if it is there: a symbolic link itself (never what it points to), a file or a directory."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


class WeightsFileError(CheckpointError, SafetensorError):
    """A consolidated weights file that safetensors cannot read (a pickle, junk); also a ``SafetensorError``, what
    callers of ``safetensors.torch.load_file`` already catch."""


class LinkedFileError(OSError, CheckpointError):
    """A file a run would write is a symbolic link, has other hard links, or is not a regular file: writing through
    it would change a file elsewhere, so it is refused (the message names the path and the fix). An ``OSError`` (no
    errno) for callers that handle failed writes, and a ``CheckpointError`` for those that handle a run's refusals."""


def refuse_linked(path: str | os.PathLike[str]) -> None:
    """Raise :class:`LinkedFileError` when ``path`` is a symbolic link, has other hard links or is not a regular file
    (nothing when it does not exist): for writers that rename a temporary file over ``path``, which never writes
    through a link but would silently replace one the user put there.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> refuse_linked(os.path.join(d.name, "run.json"))  # not there yet: fine
        >>> os.symlink("/etc/hostname", os.path.join(d.name, "run.json"))
        >>> refuse_linked(os.path.join(d.name, "run.json"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        trainloop.checkpoint.LinkedFileError: .../run.json: is a symbolic link; remove it ...
        >>> d.cleanup()
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    fix = "remove it (a run writes only its own files), or write elsewhere"
    if stat.S_ISLNK(st.st_mode):
        raise LinkedFileError(f"{path}: is a symbolic link; {fix}")
    if not stat.S_ISREG(st.st_mode):
        raise LinkedFileError(f"{path}: is not a regular file; {fix}")
    if st.st_nlink > 1:
        raise LinkedFileError(f"{path}: has {st.st_nlink} hard links (the same file under other names); {fix}")


def open_guarded(path: str | os.PathLike[str], mode: str = "w", *, append: bool = False) -> Any:
    """Open ``path`` for writing, emptied (or, with ``append``, positioned at its end), never through a link.

    Refused with :class:`LinkedFileError` before anything is written or truncated: a symbolic link (O_NOFOLLOW), a
    file with other hard links (``st_nlink > 1``: emptying it would empty the other names too) and anything but a
    regular file (a FIFO, a device). A new file gets the mode the umask gives.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> mine, theirs = os.path.join(d.name, "metrics.jsonl"), os.path.join(d.name, "notes.txt")
        >>> _ = open(theirs, "w").write("keep me")
        >>> os.link(theirs, mine)  # the same file under a second name
        >>> open_guarded(mine)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        trainloop.checkpoint.LinkedFileError: .../metrics.jsonl: has 2 hard links ...
        >>> open(theirs).read()
        'keep me'
        >>> d.cleanup()
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fix = "remove it (a run writes only its own files), or write elsewhere"
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link: ELOOP (EMLINK on FreeBSD)
            raise LinkedFileError(f"{path}: is a symbolic link; {fix}") from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, opened non-blocking
            raise LinkedFileError(f"{path}: is not a regular file (a FIFO); {fix}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LinkedFileError(f"{path}: is not a regular file; {fix}")
        if st.st_nlink > 1:
            raise LinkedFileError(
                f"{path}: has {st.st_nlink} hard links (the same file under other names): writing it would change "
                f"them too; {fix}"
            )
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode)


def open_new(path: Path, mode: str = "w") -> Any:
    """Open ``path`` for writing, emptied, never through a symbolic or hard link (:func:`open_guarded`)."""
    return open_guarded(path, mode)


def outside_links(root: str | os.PathLike[str]) -> list[tuple[Path, Path]]:
    """(link, target) for every symbolic link under ``root`` whose target resolves outside it (a link that stays
    inside is fine). Links are not followed while walking.

    Example:
        >>> import os, tempfile
        >>> run, other = tempfile.TemporaryDirectory(), tempfile.TemporaryDirectory()
        >>> os.symlink(os.path.join(other.name, "notes.txt"), os.path.join(run.name, "loss.png"))
        >>> os.symlink("metrics.jsonl", os.path.join(run.name, "inside.jsonl"))
        >>> [p.name for p, _ in outside_links(run.name)]
        ['loss.png']
        >>> run.cleanup(); other.cleanup()
    """
    base = Path(root)
    real = base.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(base):  # followlinks=False: a linked directory is not entered
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(real):
                    found.append((path, target))
    return found


def refuse_outside_links(run_dir: str | os.PathLike[str]) -> None:
    """Raise ``CheckpointError`` (one line) when ``run_dir`` holds a symbolic link to somewhere outside it: a run
    writes into its own directory only, and someone else's run directory must not make it write elsewhere."""
    if not Path(run_dir).is_dir():
        return
    links = outside_links(run_dir)
    if links:
        link, target = links[0]
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise CheckpointError(
            f"{link} is a symbolic link to {target}, outside the run directory{more}: a run writes only inside "
            f"{run_dir}; remove the link, or replace it with the file itself"
        )


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir`` (manifest present, sizes match), or None.

    Example:
        >>> import tempfile
        >>> run = tempfile.TemporaryDirectory()
        >>> latest_checkpoint(run.name) is None  # nothing saved yet
        True
        >>> store = CheckpointStore(run.name)
        >>> for step in (500, 1000):
        ...     tmp = store.begin(step)
        ...     _ = (tmp / "rank0.pt").write_bytes(b"state")
        ...     _ = store.finish(tmp, step)
        >>> latest_checkpoint(run.name).name
        'step_00001000'
        >>> _ = (store.step_dir(1000) / "rank0.pt").write_bytes(b"st")  # a file cut short: its size is wrong
        >>> latest_checkpoint(run.name).name
        'step_00000500'
        >>> run.cleanup()
    """
    return CheckpointStore(run_dir).find_resumable()[0]


def save_model_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Consolidated weights, floating tensors in fp32 (integer buffers keep their dtype); clones break tied
    storage, which safetensors refuses to write."""
    out = {}
    for k, v in state.items():
        v = v.detach().to("cpu")
        out[k] = (v.float() if v.is_floating_point() else v).contiguous().clone()
    save_file(out, str(path))


def write_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    """The checkpoint's consolidated weights: through the model's own ``save_pretrained(directory, state_dict=)``
    when it has one (its own layout, with its config, loadable by its ``from_pretrained``), else ``model.safetensors``
    holding ``state`` as is."""
    own: Callable[..., Any] | None = getattr(module, "save_pretrained", None)
    if own is not None:
        own(directory, state_dict=state)
    else:
        save_model_weights(state, directory / MODEL_FILE)


def read_weights(module: torch.nn.Module, checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> None:
    """Load a checkpoint's consolidated weights into ``module`` strictly; a tied weight stored once under one of
    its names (as ``save_pretrained`` layouts do) is filled in under the others."""
    module.load_state_dict(full_model_state(module, checkpoint_dir, device))


def full_model_state(
    module: torch.nn.Module, checkpoint_dir: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """A checkpoint's consolidated weights under every state_dict name of ``module``: a tied weight stored once
    under one of its names is filled in under the others."""
    state = load_model_weights(checkpoint_dir, device)
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        present = [n for n in names if n in state]
        for n in names:
            if present and n not in state:
                state[n] = state[present[0]]
    return state


def load_model_weights(checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The consolidated fp32 model of a checkpoint, on ``device``; loads with any number of processes.

    Example (weights saved in bf16 come back in fp32):
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> checkpoint = tempfile.TemporaryDirectory()
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> save_model_weights(model.state_dict(), Path(checkpoint.name) / "model.safetensors")
        >>> weights = load_model_weights(checkpoint.name)
        >>> {name: w.dtype for name, w in weights.items()}
        {'bias': torch.float32, 'weight': torch.float32}
        >>> torch.nn.Linear(4, 2).load_state_dict(weights)
        <All keys matched successfully>
        >>> checkpoint.cleanup()
    """
    path = Path(checkpoint_dir) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no consolidated model in this checkpoint")
    try:
        return load_file(str(path), device=str(device))
    except SafetensorError as exc:  # a pickle, or any other file under the name: never unpickled
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise WeightsFileError(
            f"{path}: refused to load (not a safetensors file: {first}); a checkpoint written by this toolkit holds "
            "one, so this file was altered or comes from elsewhere: resume from another checkpoint"
        ) from None


def rng_state() -> dict[str, Any]:
    """Every RNG the loop touches (python, numpy, torch CPU and, when present, CUDA) as tensors, numbers and
    tuples only, so the state loads with ``weights_only=True``."""
    legacy = np.random.get_state(legacy=True)  # the MT19937 tuple (numpy types it as tuple or dict)
    kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", legacy)
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_torch(obj: Any, path: Path) -> None:
    with open_new(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_torch(path: Path, device: str | torch.device = "cpu") -> Any:
    """A state file of ours, with ``weights_only=True``: tensors, numbers, strings and containers only; anything
    else (a pickled object, code) is refused with one line."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # the unpickler's errors carry no stable type: UnpicklingError, RuntimeError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: refused to load (not a plain tensor/number/string state file: {first[:200]}); "
            "a checkpoint written by this toolkit never needs more, so this file was altered or comes from elsewhere"
        ) from exc
