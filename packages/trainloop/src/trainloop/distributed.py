"""Process-group setup with a collective timeout, so a dead rank makes the others fail instead of hanging."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainloop.extras import import_extra


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_distributed(engine: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """Initialise the process group when launched with more than one rank; returns (rank, world_size, device).

    gloo on CPU, nccl on CUDA. DeepSpeed runs also need its communication layer initialised, even alone.
    """
    rank, local_rank, world = env_world()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if engine == "deepspeed":
        deepspeed = import_extra("deepspeed", "deepspeed", "TrainConfig.engine='deepspeed'")

        if world == 1:
            # DeepSpeed insists on a process group; a one-rank group on a private port costs nothing.
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
    elif world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a small host tensor over ranks (moved through the GPU when the backend is nccl, which has no CPU path)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    if dist.get_backend() == "nccl":
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu)
        return on_gpu.cpu()
    dist.all_reduce(t)
    return t
