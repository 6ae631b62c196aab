"""The token file's checksum cost: SHA-256 against BLAKE2b (hashlib) on the same random bytes, in one process.

    python benchmarks/bench_hash.py [--mib 100] [--repeats 5]

Prints each hash's best rate over the repeats (GB/s), the load average at start and end, and
`sha256_vs_blake2b` (SHA-256's rate over BLAKE2b's) last. Never asserts on time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time


def best_rate(name: str, data: bytes, repeats: int) -> float:
    """Bytes per second of hashlib's `name` over `data`, the fastest of `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.new(name, data).digest()
        times.append(time.perf_counter() - t0)
    return len(data) / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100, help="bytes hashed, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="runs per hash (the fastest counts)")
    args = parser.parse_args()
    data = os.urandom(args.mib * 2**20)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.mib} MiB, best of {args.repeats}")
    rates = {}
    for name in ("sha256", "blake2b", "sha256", "blake2b"):  # alternated: each hash's best over both turns
        rates[name] = max(rates.get(name, 0.0), best_rate(name, data, args.repeats))
    for name, rate in rates.items():
        print(f"{name:8s} {rate / 1e9:6.2f} GB/s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"sha256_vs_blake2b: {rates['sha256'] / rates['blake2b']:.2f}")


if __name__ == "__main__":
    main()
