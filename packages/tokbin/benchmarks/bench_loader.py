"""Loader throughput: tokbin vs the nanoGPT batch recipe vs a raw numpy copy of the same bytes.

Writes a token file of random ids (>= 100M tokens; fewer with --quick) into a temporary directory with
write_tokens, then times B x T random-window batches three ways, in this one run:

  nanogpt recipe   a fresh np.memmap per batch, per-row astype(int64), torch.stack (nanoGPT train.py get_batch)
  tokbin gather    TokenFile.gather on RandomWindows: one fancy-index copy and one widening copy, no thread
  tokbin Loader    the same through the default Loader (prefetch_generator's BackgroundGenerator thread,
                   max_prefetch=3, which gathers the batches 3 at a time and hands them over 3 per queue item),
                   as a training loop sees it
  Loader over a Blend
                   the same Loader over a Blend of three sources (the same file opened three times, weights
                   0.7/0.2/0.1) with its BlendWindows sampler: each source gathers its rows, then they are copied
                   into one buffer in the batch's order
  BackgroundGenerator recipe
                   the conventional recipe: BackgroundGenerator(one gather per batch, max_prefetch=3), same
                   sampler, TokenFile.gather per batch, one queue item per batch
  Loader, busy     the same Loader with a consumer that sleeps 2 ms per batch (a training step that releases the
                   GIL, as a CUDA sync does): the time spent inside next() expressed as tokens/s, i.e. how fast
                   batches are handed over when the prefetch queue is kept full. Context, not the goal figure
  raw copy bound   np.copyto of the bytes one batch delivers (inputs + targets, 2*B*T int64 = 256 KiB), from a
                   64 MiB RAM array (so the source is not cache-resident) into a preallocated buffer
  raw file copy    np.copyto of the bytes one batch reads from the file (B*(T+1) uint16 = 32 KiB, one contiguous
                   slice of the memmap): the floor of any memmap loader, shown for context
  hand-off         the round trip of an item between two threads through two queue.Queue (the queue
                   BackgroundGenerator hands items over with), for context: what one wake-up of a waiting thread
                   costs here

Prints a table (best round per method), the per-round ratio of the Loader to the BackgroundGenerator
recipe (median and range over the alternating rounds), and ends with `loader_vs_nanogpt_recipe: <ratio>`
(Loader vs recipe). Never asserts on time.
Usage: python benchmarks/bench_loader.py [--quick] [--tokens N] [--batches N] [--rounds N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokbin import Blend, Loader, RandomWindows, TokenFile, write_tokens
from tokbin.fileformat import HEADER_SIZE

B, T = 16, 1024
VOCAB = 50257


def make_file(path: Path, n_tokens: int) -> None:
    rng = np.random.default_rng(0)
    chunk = 10_000_000
    docs = (rng.integers(0, VOCAB, size=min(chunk, n_tokens - i), dtype=np.uint16) for i in range(0, n_tokens, chunk))
    write_tokens(path, docs, vocab_size=VOCAB)


def nanogpt_get_batch(path: Path, n_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # nanoGPT train.py get_batch, pointed at the token region of the same file
    data = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_SIZE, shape=(n_tokens,))
    ix = torch.randint(len(data) - T, (B,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
    return x, y


def hand_off_round_trip_us(n: int = 3000) -> float:
    """Mean of n round trips of an item through two queue.Queue between two threads, in us.

    Context for the Loader rows: every queue item the consumer waits for costs at least one such one-way wake-up.
    """
    there, back = queue.Queue(1), queue.Queue(1)

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    for i in range(100):
        there.put(i)
        back.get()
    t0 = time.perf_counter()
    for i in range(n):
        there.put(i)
        back.get()
    elapsed = time.perf_counter() - t0
    there.put(None)
    thread.join()
    return elapsed / n * 1e6


def interleaved_rounds(fns: dict, n_batches: int, rounds: int) -> dict[str, list[float]]:
    """Tokens/s (B*T per batch) per method in each of ``rounds`` timed runs of ``n_batches`` each, after a warm-up.

    The methods take turns within each round, so on a shared machine a burst of load from other jobs falls on
    all of them rather than on whichever happened to run at that moment.
    """
    for fn in fns.values():
        for _ in range(min(50, n_batches)):
            fn()
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n_batches):
                fn()
            rates[name].append(n_batches * B * T / (time.perf_counter() - t0))
    return rates


def background_generator_recipe(tf: TokenFile, max_prefetch: int = 3) -> Iterator:
    """``BackgroundGenerator`` over one ``gather`` per batch, with its own RandomWindows stream.

    It cannot be stopped (BackgroundGenerator has no close()): its daemon thread stays blocked on a full queue
    until the process exits, which costs nothing while another method is timed.
    """
    from prefetch_generator import BackgroundGenerator

    sampler = RandomWindows(tf.n_tokens, T, B, seed=4)
    return BackgroundGenerator((tf.gather(*sampler.batch(k)) for k in itertools.count()), max_prefetch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M tokens and fewer batches (not the 100M goal setup)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--batches", type=int, default=None, help="batches per timed run (default 1000, --quick 200)")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs per method, interleaved; the best is kept")
    args = ap.parse_args()
    n_tokens = args.tokens or (10_000_000 if args.quick else 100_000_000)
    n_batches = args.batches or (200 if args.quick else 1000)

    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        path = Path(tmp) / "tokens.bin"
        t0 = time.perf_counter()
        make_file(path, n_tokens)
        write_s = time.perf_counter() - t0
        tf = TokenFile(path)
        gen = torch.Generator().manual_seed(0)
        it = iter(RandomWindows(tf.n_tokens, T, B, seed=0))
        loader = Loader(tf, RandomWindows(tf.n_tokens, T, B, seed=1), max_prefetch=3)

        src = np.random.default_rng(0).integers(0, VOCAB, size=256 * 2 * B * T, dtype=np.int64)  # 64 MiB in RAM
        dst = np.empty(2 * B * T, dtype=np.int64)
        pos = [0]

        def raw_copy() -> None:
            lo = pos[0]
            np.copyto(dst, src[lo : lo + dst.size])
            pos[0] = (lo + dst.size) % src.size

        ids = np.asarray(tf.tokens)
        dst16 = np.empty(B * (T + 1), dtype=ids.dtype)
        offsets = np.random.default_rng(2).integers(0, n_tokens - dst16.size, size=4096)
        k = [0]

        def raw_file_copy() -> None:
            o = offsets[k[0] % offsets.size]
            np.copyto(dst16, ids[o : o + dst16.size])
            k[0] += 1

        bg_recipe = background_generator_recipe(tf)
        blend = Blend([TokenFile(path) for _ in range(3)], [0.7, 0.2, 0.1])
        with loader, Loader(blend, blend.sampler(T, B, seed=5), max_prefetch=3) as blend_loader:
            rounds = interleaved_rounds(
                {
                    "recipe": lambda: nanogpt_get_batch(path, n_tokens, gen),
                    "gather": lambda: tf.gather(*next(it)),
                    "loader": lambda: next(loader),
                    "bg_recipe": lambda: next(bg_recipe),
                    "blend": lambda: next(blend_loader),
                    "bound": raw_copy,
                    "file_copy": raw_file_copy,
                },
                n_batches,
                args.rounds,
            )
        rates = {name: max(r) for name, r in rounds.items()}

        with Loader(tf, RandomWindows(tf.n_tokens, T, B, seed=2), max_prefetch=3) as busy:
            waited = 0.0
            n_busy = min(n_batches, 500)
            for _ in range(n_busy):
                time.sleep(0.002)
                t0 = time.perf_counter()
                next(busy)
                waited += time.perf_counter() - t0
            busy_rate = n_busy * B * T / waited

    recipe, gather, loader_rate, bound = rates["recipe"], rates["gather"], rates["loader"], rates["bound"]
    file_copy = rates["file_copy"]
    rows = [
        ("nanogpt recipe", recipe),
        ("tokbin gather (no thread)", gather),
        ("tokbin Loader (prefetch 3)", loader_rate),
        ("Loader over a 3-source Blend", rates["blend"]),
        ("BackgroundGenerator recipe", rates["bg_recipe"]),
        ("Loader, busy consumer (context)", busy_rate),
        ("raw copy bound", bound),
        ("raw file copy (context)", file_copy),
    ]
    print(f"load average at the end (2 cores, shared): {os.getloadavg()[0]:.1f}")
    print(
        f"token file: {n_tokens:,} tokens (uint16), written in {write_s:.1f} s; B={B}, T={T}, "
        f"{args.rounds} interleaved rounds of {n_batches} batches, best round shown"
    )
    print(f"{'method':30} {'tokens/s':>14} {'batches/s':>10} {'vs recipe':>10} {'of bound':>9}")
    for name, rate in rows:
        print(f"{name:30} {rate:14,.0f} {rate / (B * T):10,.0f} {rate / recipe:9.2f}x {rate / bound:8.1%}")
    round_trip = hand_off_round_trip_us()
    print(
        f"thread hand-off round trip (queue.Queue ping-pong, context): {round_trip:.0f} us; "
        f"the gather alone takes {1e6 * B * T / gather:.0f} us per batch"
    )
    ratios = sorted(a / b for a, b in zip(rounds["loader"], rounds["bg_recipe"], strict=True))
    print(
        f"Loader / BackgroundGenerator recipe, per round: median {statistics.median(ratios):.2f}x "
        f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x), Loader faster in {sum(r > 1 for r in ratios)} of {len(ratios)}"
    )
    print(f"gather_vs_nanogpt_recipe: {gather / recipe:.2f}")
    print(f"loader_fraction_of_bound: {loader_rate / bound:.3f}")
    print(f"loader_vs_nanogpt_recipe: {loader_rate / recipe:.2f}")


if __name__ == "__main__":
    main()
