"""Resume cost of a large checkpoint: verify="full" (every file's SHA-256) against verify="sizes" (sizes only).

    python benchmarks/bench_resume.py [--gb 2] [--dir DIR] [--rounds 3]

The checkpoint is written by the real save path, ``Trainer.save_checkpoint`` with the torch engine, after one real
training step of a model of ``n`` square fp32 ``Linear(4096, 4096)`` layers (no bias; as many as make about ``--gb``
GB): ``model.safetensors`` (fp32 weights, 4 bytes per parameter), ``trainer.pt`` (AdamW's ``exp_avg`` and
``exp_avg_sq``, 8 bytes per parameter, and the loop's state), ``rank0.pt`` and three small JSON files, then
``manifest.json``. It goes to a temporary directory under ``--dir`` (default: the system's temporary directory);
the filesystem type is printed, since tmpfs (memory) and a disk read very differently.

Each round times, for ``full`` and ``sizes`` in alternating order, what ``Trainer.fit(resume=True, verify=...)``
does: ``CheckpointStore.find_resumable(verify)`` (the verify time), then ``Trainer.load_checkpoint`` (weights
and optimizer state into the live model and optimizer); resume = verify + load. Each is timed twice: first after
``posix_fadvise(DONTNEED)`` has asked the kernel to drop the checkpoint's pages from the page cache (an unprivileged
stand-in for dropping the whole cache: it works on a disk filesystem, does nothing on tmpfs), then again with the
files warm in the page cache from that first read. Under ``full`` the hash reads every byte first, so its load is
warm even in the first pass. Medians over the rounds; nothing is asserted. Last line:
``resume_sizes_vs_full: X``, the first-read resume time under full divided by that under sizes (how many times
faster the default resumes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainloop import TrainConfig, Trainer

WIDTH = 4096
BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments


class Wide(nn.Module):
    """``n`` square layers: parameters in a few large tensors, as a big model's state is."""

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n_layers))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = inputs  # (B, WIDTH)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.mse_loss(h, targets)


def filesystem(path: Path) -> str:
    """The type and mount point of the filesystem holding ``path`` (the longest matching mount in /proc/mounts)."""
    best = ("?", "")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, kind = line.split()[:3]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[1]):
                best = (kind, mount)
    return f"{best[0]} ({best[1]})"


def evict(ckpt: Path) -> None:
    """Ask the kernel to drop the checkpoint's pages from the page cache (flushed first: dirty pages stay)."""
    for path in ckpt.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_resume(trainer: Trainer, verify: str) -> tuple[float, float]:
    """(verify seconds, resume seconds) of one resume: find_resumable(verify), then load_checkpoint."""
    gc.collect()
    t0 = time.perf_counter()
    ckpt, skipped = trainer.store.find_resumable(verify)
    t1 = time.perf_counter()
    if ckpt is None:
        raise RuntimeError(f"no resumable checkpoint under {trainer.store.root}: {skipped}")
    with contextlib.redirect_stdout(io.StringIO()):  # "resumed from ..."
        trainer.load_checkpoint(ckpt)
    return t1 - t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes), about (default 2)")
    ap.add_argument("--dir", default=None, help="where the temporary checkpoint goes (default: the system's tmp)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each timing both modes (default 3)")
    args = ap.parse_args()
    n_layers = max(1, round(args.gb * 1e9 / (BYTES_PER_PARAM * WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = Wide(n_layers)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = TrainConfig(max_steps=1, micro_batch=1, lr=1e-4, progress=False, keep_best=False, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench_resume-", dir=args.dir) as run_dir:
        batch = (torch.randn(1, WIDTH), torch.randn(1, WIDTH))
        trainer = Trainer(model, cfg, iter([batch]), run_dir=run_dir)
        trainer.train_step(iter([batch]))  # a real step: AdamW's moments exist, as in any checkpoint worth resuming
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # "saved checkpoint ..."
            ckpt = trainer.save_checkpoint()
        save_s = time.perf_counter() - t0
        files = sorted((p for p in ckpt.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
        total = sum(p.stat().st_size for p in files)
        print(f"model: {n_layers} x Linear({WIDTH}, {WIDTH}, bias=False), {n_params / 1e6:.1f}M fp32 parameters, "
              f"one AdamW step taken; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")  # fmt: skip
        print(f"checkpoint: {ckpt} on {filesystem(ckpt)}, {total / 1e9:.3f} GB: "
              + ", ".join(f"{p.name} {p.stat().st_size / 1e9:.3f} GB" for p in files[:2])
              + f", {len(files) - 2} small files (manifest included)")  # fmt: skip
        print(f"save (Trainer.save_checkpoint: write, SHA-256 of every file, fsync, rename): {save_s:.2f} s")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"\n{'round':<6} {'verify':<7} {'read':<12} {'verify s':>9} {'load s':>8} {'resume s':>9}")
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for verify in ("full", "sizes") if r % 2 == 0 else ("sizes", "full"):
                evict(ckpt)
                for read in ("first", "page cache"):
                    v, total_s = time_resume(trainer, verify)
                    times.setdefault((verify, read), []).append((v, total_s))
                    print(f"{r + 1:<6} {verify:<7} {read:<12} {v:9.3f} {total_s - v:8.3f} {total_s:9.3f}")
        med = {k: (statistics.median(v for v, _ in t), statistics.median(s for _, s in t)) for k, t in times.items()}
        print(f"\nmedians of {args.rounds} rounds")
        for (verify, read), (v, s) in sorted(med.items()):
            rate = f"  (hash {total / 1e9 / v:.2f} GB/s)" if verify == "full" else ""
            print(f"  {verify:<6} {read:<11} verify {v:8.3f} s  resume {s:8.3f} s{rate}")
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        warm = med[("full", "page cache")][1] / med[("sizes", "page cache")][1]
        print(f"resume_sizes_vs_full_page_cache: {warm:.2f}")
        print(f"resume_sizes_vs_full: {med[('full', 'first')][1] / med[('sizes', 'first')][1]:.2f}")


if __name__ == "__main__":
    main()
