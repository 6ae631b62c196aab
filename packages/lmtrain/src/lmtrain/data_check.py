"""Token data is checked before training, not trusted.

Every run, at no cost worth counting, for every token file (each shard of a shard directory, each source of a
blend): the header (magic, version, its own checksum) and the exact file size, which opening a tokbin TokenFile
checks, and that the vocab_size in the header does not exceed the model's.

On a file's first use, once: tokbin's ``verify()``, which reads every byte: the SHA-256 of the data against the one
in the header, every id below the header's vocab_size, the document index. A pass is cached in
``.lmtrain-verified.json`` beside the token file (in the run directory where the data directory is read-only),
keyed by the file's size, modification time and inode, so later runs of a 32 GB file read none of it; a file
rewritten, touched or copied is verified again. Concurrent runs and the ranks of one job take a lock beside the
cache while they verify, so one process reads the file and the others find its result.

Why this is where token ids are checked: together the two checks prove that every id in the file is below the
model's vocab_size (ids < the header's vocab_size <= the model's), so no id can reach the embedding out of range
and no per-batch check is needed (on a GPU a per-batch check is either a host sync every step or a device-side
assert that kills the process without a message). What they cannot see is a file changed in place while a run
reads it, which no tokbin writer does (they write a temporary file and rename it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

CACHE_FILE = ".lmtrain-verified.json"
LOCK_FILE = ".lmtrain-verified.lock"
CACHE_VERSION = 1


def token_files(dataset: Any) -> list[Any]:
    """The TokenFiles a dataset reads: itself, the shards of a ShardedTokens, the sources of a Blend (recursively)."""
    for parts in ("shards", "sources"):
        if hasattr(dataset, parts):
            return [tf for part in getattr(dataset, parts) for tf in token_files(part)]
    return [dataset]


def check_token_data(
    datasets: Iterable[Any],
    model_vocab_size: int,
    *,
    fallback_cache_dir: str | os.PathLike | None = None,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Check the token files of ``datasets`` (paths, TokenFiles, ShardedTokens, Blends) before training.

    Raises LmtrainError (one line: the file, what was expected, the fix) for a header that records more ids than
    the model has, a damaged header or size, or data that fails its checksum or id check. Returns the paths that
    were read in full this time (those not found in the cache).

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> import tokbin
        >>> data = tempfile.TemporaryDirectory()
        >>> _ = tokbin.write_tokens(f"{data.name}/train.bin", np.arange(1000) % 500, vocab_size=500)
        >>> check_token_data([f"{data.name}/train.bin"], 512)  # doctest: +ELLIPSIS
        lmtrain: verifying .../train.bin (0.00 GB: SHA-256 and token ids; once, the result is kept in ...)
        ['.../train.bin']
        >>> check_token_data([f"{data.name}/train.bin"], 512)  # verified before: nothing read
        []
        >>> check_token_data([f"{data.name}/train.bin"], 400)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: .../train.bin: its header says vocab_size 500, the model's vocab_size is 400: ...
        >>> data.cleanup()
    """
    import tokbin

    verified = []
    for dataset in datasets:
        if isinstance(dataset, (str, os.PathLike)):
            try:
                dataset = tokbin.open_tokens(dataset)
            except tokbin.TokenFileError as exc:
                raise LmtrainError(f"{exc}; re-run `lmtrain prepare` (or copy the data again)") from None
        for tf in token_files(dataset):
            if tf.vocab_size > model_vocab_size:
                raise LmtrainError(
                    f"{tf.path}: its header says vocab_size {tf.vocab_size}, the model's vocab_size is "
                    f"{model_vocab_size}: ids up to {tf.vocab_size - 1} would index past the embedding table; train "
                    f"a model with vocab_size >= {tf.vocab_size} (--set vocab_size={tf.vocab_size}) or encode the "
                    f"data with a tokenizer of at most {model_vocab_size} pieces"
                )
            if _verify_once(tf, fallback_cache_dir, say):
                verified.append(str(tf.path))
    return verified


def _key(tf: Any) -> tuple[str, dict[str, Any]]:
    st = os.stat(tf.path)
    return tf.path.name, {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                          "data_sha256": tf.data_sha256}  # fmt: skip


def _verify_once(tf: Any, fallback_dir: str | os.PathLike | None, say: Callable[[str], None]) -> bool:
    """tokbin's verify() of one TokenFile unless a cache vouches for it; True when it was read in full."""
    import tokbin

    name, identity = _key(tf)
    here = Path(tf.path).resolve().parent
    places = [(here, name)]
    if fallback_dir is not None:
        places.append((Path(fallback_dir), str(Path(tf.path).resolve())))
    if any(_cached(directory, key, identity) for directory, key in places):
        return False
    for directory, key in places:
        with _locked(directory) as locked:
            if not locked:
                continue  # read-only: try the next place
            if _cached(directory, key, identity):  # another process verified it while we waited for the lock
                return False
            size = identity["bytes"]
            say(f"lmtrain: verifying {tf.path} ({size / 1e9:.2f} GB: SHA-256 and token ids; once, the result is "
                f"kept in {directory / CACHE_FILE})")  # fmt: skip
            try:
                report = tf.verify()
            except tokbin.TokenFileError as exc:
                raise LmtrainError(
                    f"{exc}: the file changed or was damaged after it was written (a copy cut short, a concurrent "
                    "writer, a failing disk); re-run `lmtrain prepare` or copy the data again"
                ) from None
            _store(directory, key, {**identity, "max_id": int(report["max_id"])})
            return True
    # No place to keep the result: verify every time rather than trust the file.
    say(f"lmtrain: verifying {tf.path} (no writable place for a cache: {', '.join(str(d) for d, _ in places)})")
    try:
        tf.verify()
    except tokbin.TokenFileError as exc:
        raise LmtrainError(f"{exc}: re-run `lmtrain prepare` or copy the data again") from None
    return True


def _read_cache(directory: Path) -> dict[str, Any]:
    try:
        data = json.loads((directory / CACHE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    ok = isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict)
    return data["files"] if ok else {}


def _cached(directory: Path, key: str, identity: dict[str, Any]) -> bool:
    entry = _read_cache(directory).get(key)
    return isinstance(entry, dict) and all(entry.get(k) == v for k, v in identity.items())


def _store(directory: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one entry, replacing the cache atomically (a crash leaves the old cache or the new one)."""
    from lmtrain.json_files import write_json_atomic

    files = _read_cache(directory)
    files[key] = entry
    with contextlib.suppress(OSError):  # a cache we cannot write only costs the next run a verification
        write_json_atomic(directory / CACHE_FILE, {"version": CACHE_VERSION, "files": files})


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[bool]:
    """Hold ``directory/.lmtrain-verified.lock`` (waiting for another verifier); yields False where the directory
    is not writable."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError:
        yield False
        return
    try:
        with contextlib.suppress(OSError):  # no locks on this filesystem (ENOLCK): at worst two processes verify
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)
