"""The kit's DeepSpeed config adapted for a CPU rehearsal of the launch (`launch.sh --cpu-rehearsal`).

Only what CPUs or the rehearsal's world size require changes: DeepSpeed has no fp16 on CPU (bf16 works), so an
fp16 block becomes bf16; `train_batch_size` becomes micro batch x accumulation x the hostfile's world size. ZeRO
stage, offload, bucket sizes and the rest stay as the kit has them. Prints the `lmtrain train` flags that make the
training config agree with the adapted file, one per line.

    python3 tools/cluster-3090/cpu_rehearsal.py tools/cluster-3090/ds_config.json 4 --write RUN_DIR/ds.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


class RehearsalError(ValueError):
    """The kit's DeepSpeed config cannot be adapted (the message names the file and the key)."""


def adapt(ds: dict[str, Any], world_size: int, source: str = "ds_config.json") -> tuple[dict[str, Any], list[str]]:
    """(the adapted config, the `lmtrain train` flags that match it).

    Example:
        >>> ds, flags = adapt({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        ...                    "train_batch_size": 128, "bf16": {"enabled": True}}, 4)
        >>> ds["train_batch_size"], flags
        (32, ['--set', 'precision=bf16', '--set', 'micro_batch=2', '--set', 'grad_accum=4'])
    """
    ds = copy.deepcopy(ds)
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps", 1)
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RehearsalError(f"{source}: {key}={value!r} must be a positive integer for the rehearsal to size it")
    if ds.get("fp16", {}).get("enabled"):
        ds.pop("fp16")
        ds["bf16"] = {"enabled": True}
    ds["train_batch_size"] = micro * accum * world_size
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
    flags = ["--set", f"precision={precision}", "--set", f"micro_batch={micro}", "--set", f"grad_accum={accum}"]
    return ds, flags


def write_atomic(path: Path, ds: dict[str, Any]) -> None:
    """Every node may write the same file on shared storage at once: each renames its own complete copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(ds, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpu_rehearsal.py", description=__doc__.splitlines()[0])
    parser.add_argument("ds_config", help="the kit's DeepSpeed config")
    parser.add_argument("world_size", type=int, help="ranks of the rehearsal (nodes x slots of the hostfile)")
    parser.add_argument("--write", metavar="PATH", help="write the adapted config there (else only print the flags)")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"world_size {args.world_size} must be at least 1")
    try:
        ds = json.loads(Path(args.ds_config).read_text())
        if not isinstance(ds, dict):
            raise RehearsalError(f"{args.ds_config}: expected a JSON object")
        adapted, flags = adapt(ds, args.world_size, args.ds_config)
        if args.write:
            write_atomic(Path(args.write), adapted)
    except (OSError, json.JSONDecodeError, RehearsalError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
