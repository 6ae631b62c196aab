"""Process-group setup with a collective timeout, so a dead rank makes the others fail instead of hanging, and its
teardown before the interpreter exits."""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainloop.config import ConfigError
from trainloop.extras import import_extra


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_distributed(engine: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """Initialise the process group when launched with more than one rank; returns (rank, world_size, device).

    gloo on CPU, nccl on CUDA. DeepSpeed runs also need its communication layer initialised, even alone. A group
    set up here is destroyed by :func:`teardown_distributed`, which also runs at exit (see there); a group the
    caller initialised before is left to the caller.
    """
    rank, local_rank, world = env_world()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if engine == "deepspeed":
        deepspeed = import_extra("deepspeed", "deepspeed", "TrainConfig.engine='deepspeed'")
        from trainloop.extension_locks import stale_extension_lock_message

        # DeepSpeed's communication layer builds its op first thing; a lock left by a killed build makes every rank
        # wait on it forever, without a word: say so and stop instead, before any rank waits on anything.
        stale = stale_extension_lock_message()
        if stale is not None:
            raise ConfigError(stale)

        choose_port = world == 1 and "MASTER_PORT" not in os.environ
        if world == 1:
            # DeepSpeed insists on a process group; a one-rank group on a private port costs nothing.
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        initialised = dist.is_initialized()

        def init() -> None:
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)

        if choose_port and not initialised:
            init_on_a_free_port(init)
        else:
            init()
        _own(not initialised)
    elif world > 1 and not dist.is_initialized():
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world} but {', '.join(missing)} not set: torch.distributed cannot start "
                f"TrainConfig.engine={engine!r} on {world} ranks; launch with torchrun --nproc_per_node {world} "
                "(or the deepspeed launcher), or unset WORLD_SIZE for one process"
            )
        dist.init_process_group(backend, timeout=timeout)
        _own(True)
    elif engine == "fsdp" and not dist.is_initialized():
        # fully_shard needs a process group, even for one rank: a one-rank group on a private port costs nothing.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        init_on_a_free_port(lambda: dist.init_process_group(backend, timeout=timeout, rank=0, world_size=1))
        _own(True)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, device


_owned = False  # whether setup_distributed initialised the default process group (and so must destroy it)
_atexit_registered = False


def _own(initialised_here: bool) -> None:
    global _owned, _atexit_registered
    if not initialised_here or not dist.is_initialized():
        return
    _owned = True
    if not _atexit_registered:
        atexit.register(teardown_distributed)
        _atexit_registered = True


def teardown_distributed() -> None:
    """Destroy the process group that :func:`setup_distributed` initialised; a no-op otherwise, and when called twice.

    It first waits until no collective's worker thread still holds one of trainloop's buffers (see ``_BUFFERS``),
    then, the group destroyed, until every gloo worker thread is idle (see :func:`wait_for_idle_gloo_workers`), so
    that nothing is left for a worker to free while the interpreter finalises: not trainloop's buffers, nor the
    temporaries of torch's own collectives (FSDP's reduce-scatters and all-gathers, distributed checkpoint's).
    ``Trainer.close()`` calls this; it is also registered with ``atexit`` (which runs while the interpreter is still
    whole) for scripts that never close their Trainer. The gloo threads themselves may outlive it: a module wrapped
    by DistributedDataParallel or FSDP keeps its group alive in C++ after the group is destroyed, and they end with
    the process.
    """
    global _owned
    if _owned and dist.is_available() and dist.is_initialized():
        _release_buffers()
        dist.destroy_process_group()
        wait_for_idle_gloo_workers()
    _owned = False


GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each gloo process group's worker threads (Linux)
_IDLE_WAIT_S = 30.0  # wait_for_idle_gloo_workers' bound
_IDLE_LOOK_S = 0.01  # and the time between its looks


def _gloo_workers() -> dict[str, tuple[str, ...]]:
    """Each gloo worker thread of this process: its scheduler state and context-switch counts (Linux's /proc);
    nothing where /proc is missing."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    found = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # the thread ended between the listing and the read
        if fields.get("Name", "").strip() == GLOO_WORKER:
            keys = ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
            found[tid] = tuple(fields.get(k, "").strip() for k in keys)
    return found


def wait_for_idle_gloo_workers(timeout_s: float = _IDLE_WAIT_S) -> bool:
    """Wait until every gloo worker thread of this process is idle; True when they are (or there are none), False
    after ``timeout_s``.

    A worker lets go of a finished collective's tensors a moment after the caller's ``wait()`` returned, and when
    that frees a tensor's Python object it needs the GIL; should the interpreter be finalising by then (a loaded
    machine can hold the thread back that long), the thread is made to exit inside a C++ destructor and the process
    aborts ("terminate called without an active exception"). This sleeps between looks, so the GIL is free for such
    a thread, and returns once two looks ``_IDLE_LOOK_S`` apart find every worker asleep (state S) with the same
    context-switch counts: a worker that wanted the GIL would have taken it and run in between. Where /proc is
    missing (not Linux) it returns at once.
    """
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        now = _gloo_workers()
        if not now or (now == previous and all(state.startswith("S") for state, *_ in now.values())):
            return True
        if time.monotonic() >= deadline:
            return False
        previous = now
        time.sleep(_IDLE_LOOK_S)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 5  # ports init_on_a_free_port tries before it gives up


def init_on_a_free_port(init: Callable[[], None], attempts: int = PORT_ATTEMPTS) -> None:
    """Run ``init`` (which binds ``MASTER_PORT``, as a one-rank process group's store does) on a port that was free
    when chosen, and on another when that one was taken before ``init`` bound it (EADDRINUSE): a free port is free
    only until someone binds it, and DeepSpeed's first start builds its communication op (a minute or more) between
    the choice and the bind. At most ``attempts`` ports; the last one's error is raised as it is."""
    for attempt in range(1, attempts + 1):
        os.environ["MASTER_PORT"] = str(_free_port())
        try:
            init()
            return
        except Exception as exc:
            text = str(exc)
            if attempt == attempts or not ("EADDRINUSE" in text or "address already in use" in text.lower()):
                raise


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# Every tensor trainloop hands to a collective is one of these buffers, kept for the life of the process. A gloo
# worker thread lets go of a finished collective's tensors a moment after the caller's wait() returned; when the
# caller's own tensor was a temporary, that last release frees the Python object behind it and needs the GIL, and
# if the interpreter is finalising by then (a loaded machine can hold the thread back that long), the process
# aborts ("terminate called without an active exception"). Buffers that outlive every collective are never freed
# by a worker; teardown_distributed waits until no worker holds one.
_BUFFERS: dict[tuple[torch.dtype, int, str], torch.Tensor] = {}
_CHUNK = 1 << 16  # bytes per collective when broadcast_json moves a document
_RELEASE_WAIT_S = 60.0  # teardown's bound on waiting for the workers to let go of the buffers


def _buffer(dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    key = (dtype, numel, str(device))
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(numel, dtype=dtype, device=device)
    return _BUFFERS[key]


def _release_buffers() -> None:
    """Wait (bounded) until no collective's worker still holds one of the buffers; the wait sleeps, so it never
    holds the GIL a worker may need."""
    deadline = time.monotonic() + _RELEASE_WAIT_S
    # _use_count: how many references the tensor's C++ object has (a private torch method, not in its stubs).
    while any(b._use_count() > 1 for b in _BUFFERS.values()) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.001)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a small host tensor over ranks, in place (moved through the GPU when the backend is nccl, which has no
    CPU path); returns it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    buf = _buffer(t.dtype, t.numel(), device)
    buf.copy_(t.reshape(-1))
    dist.all_reduce(buf)
    t.copy_(buf.view(t.shape))
    return t


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank: sent as JSON (no pickle), through all_reduce_sum's buffers."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    mine = dist.get_rank() == src
    payload = json.dumps(obj).encode() if mine else b""
    n = int(all_reduce_sum(torch.tensor([len(payload) if mine else 0], dtype=torch.int64))[0])
    received = bytearray()
    for start in range(0, n, _CHUNK):
        size = min(_CHUNK, n - start)
        chunk = torch.zeros(size, dtype=torch.uint8)
        if mine:
            chunk.copy_(torch.frombuffer(bytearray(payload[start : start + size]), dtype=torch.uint8))
        received += bytes(all_reduce_sum(chunk).numpy())
    return obj if mine else json.loads(received.decode())
