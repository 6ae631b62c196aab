"""Build DeepSpeed's JIT ops into torch's extension cache (TORCH_EXTENSIONS_DIR) before the tests that load them.

    python tools/build_deepspeed_ops.py [--lock FILE] BUILDER...

BUILDER is a name of DeepSpeed's accelerator op builders (AsyncIOBuilder, PinMemoryBuilder, ShareMemCommBuilder).
Each builds with DeepSpeed's own flags; one that is not buildable here, or fails to build, is reported and left to
the tests, which skip or fail with the reason. The exit status is 0 either way.

--lock FILE: hold an exclusive lock on FILE while building. Two nox sessions that build the same ops at once would
both miss the compiler cache (ccache, set up by .ci/run) and compile every object twice side by side; with the lock
the second waits for the first and takes every object from the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _held(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - started
        if waited >= 1:
            print(f"waited {waited:.0f} s for another build of DeepSpeed's ops ({path})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("builders", nargs="+", metavar="BUILDER")
    parser.add_argument("--lock", type=Path, help="hold an exclusive lock on this file while building")
    args = parser.parse_args(argv)
    from deepspeed.accelerator import get_accelerator

    with _held(args.lock):
        for name in args.builders:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                print(f"{name}: not buildable here, left to the tests", flush=True)
                continue
            started = time.monotonic()
            try:
                builder.load(verbose=False)
            except Exception as error:  # any failure is the tests' to report, with its reason
                print(f"{name}: did not build ({type(error).__name__}: {error}), left to the tests", flush=True)
            else:
                print(f"{name}: built in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
