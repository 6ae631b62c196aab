"""The FSDP engine's checkpoint files, inside the loop's atomic, manifest-checked checkpoint directory.

``fsdp_checkpoint="sharded"`` (default): ``dcp/`` holds ``torch.distributed.checkpoint``'s files, one
``__<rank>_0.distcp`` per rank plus ``.metadata``, written from ``get_state_dict`` (model and AdamW state as
DTensors) and read back through ``set_state_dict``; a run on another number of ranks loads them as they are, each
rank reading the slices of its new shards. ``fsdp_checkpoint="full"``: ``optimizer.pt``, the whole AdamW state
keyed by parameter name, written by rank 0; on load rank 0 reads it and the consolidated weights and broadcasts
them, and every rank keeps its shard (small models: the whole state passes through rank 0's memory).

Both write ``trainer.pt`` (the loop's state, rank 0) and the consolidated fp32 weights (rank 0).

``torch.distributed.checkpoint``'s reader unpickles ``.metadata`` and ``torch.load``s non-tensor values with
``weights_only=False``; :class:`SafeReader` and :class:`SafeLoadPlanner` read them with an allow-list of its own
metadata classes and ``weights_only=True`` instead, so a checkpoint directory cannot run code.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from trainloop.checkpoint import CheckpointError, full_model_state, load_torch, save_torch, write_weights
from trainloop.distributed import broadcast_json

if TYPE_CHECKING:
    from trainloop.engine_fsdp import FSDPEngine

DCP_SUBDIR = "dcp"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"

# Everything the metadata of a checkpoint this engine writes holds, besides builtins (read off torch 2.13's files).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )  # fmt: skip
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Python 3.13 defines (and pickles) the path classes in pathlib._local; earlier Pythons have no such module.
        # Either spelling reads as pathlib's own class, so a checkpoint moves between Pythons both ways.
        module = "pathlib" if module == "pathlib._local" else module
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):  # fmt: skip
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata class")


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is read with an allow-list of checkpoint classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: refused to load ({exc}); this file was altered or comes from elsewhere"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
        check_storage_paths(metadata, Path(self.path), path)
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def check_storage_paths(metadata: Metadata, root: Path, where: Path) -> None:
    """Raise ``CheckpointError`` (one line) unless every storage entry of ``metadata`` names a file inside ``root``
    by a plain relative name, with a non-negative offset and length and no transform (this engine writes none).

    The reader opens ``root / relative_path`` for each entry: a name such as ``../../elsewhere/x.distcp`` would make
    it read a file outside the checkpoint, so it is refused before any data file is opened.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where}: no storage table (found {type(storage).__name__}): not checkpoint metadata")
    real = root.resolve()
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{where}: storage entry {index!r} is a {type(info).__name__}, expected file info")
        rel = info.relative_path
        inside = isinstance(rel, str) and rel and not Path(rel).is_absolute() and ".." not in Path(rel).parts
        if not inside or not (root / rel).resolve().is_relative_to(real):
            raise CheckpointError(
                f"{where}: storage entry names {rel!r}, outside the checkpoint directory {root}: refused before "
                "reading it; this file was altered or comes from elsewhere"
            )
        numbers = (info.offset, info.length)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise CheckpointError(f"{where}: storage entry for {rel!r} has offset/length {numbers}: expected counts")
        if info.transform_descriptors:
            raise CheckpointError(f"{where}: storage entry for {rel!r} asks for transforms "
                                  f"{list(info.transform_descriptors)[:3]}: this engine writes none")  # fmt: skip


class SafeLoadPlanner(DefaultLoadPlanner):
    """The default planner, reading non-tensor values (AdamW's hyper-parameters) with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_fsdp(engine: FSDPEngine, ckpt_dir: Path, client_state: dict[str, Any], rank: int) -> None:
    """Write the engine's state (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if engine.config.fsdp_checkpoint == "sharded":
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=FileSystemWriter(ckpt_dir / DCP_SUBDIR))
        weights = engine.full_state_dict()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_weights, optim_sd = get_state_dict(engine.module, engine.optimizer, options=options)
        weights = cast("dict[str, torch.Tensor]", full_weights)
        if rank == 0:
            save_torch(optim_sd, ckpt_dir / OPTIMIZER_FILE)
    if rank == 0:
        write_weights(engine.module, weights, ckpt_dir)
        save_torch(client_state, ckpt_dir / TRAINER_FILE)


def load_fsdp(engine: FSDPEngine, ckpt_dir: Path) -> dict[str, Any]:
    """Restore the state either kind of checkpoint holds (collective); returns the loop's state saved with it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if (ckpt_dir / DCP_SUBDIR).is_dir():
        # get_state_dict initialises AdamW's state where it has none yet, so every tensor has a slot to load into.
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        from torch.distributed.checkpoint.api import CheckpointException

        reader = SafeReader(ckpt_dir / DCP_SUBDIR)
        reader.read_metadata()  # checked here first: dcp.load would log each refusal with a traceback, then wrap it
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as exc:  # a rank's failure, wrapped by torch (a BaseException)
            raise CheckpointError(dcp_failure(exc, ckpt_dir / DCP_SUBDIR)) from None
        set_state_dict(engine.module, engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
    elif (ckpt_dir / OPTIMIZER_FILE).is_file():
        main = not dist.is_initialized() or dist.get_rank() == 0
        full = broadcast_state(
            {"model": full_model_state(engine.module, ckpt_dir), "optimizer": load_torch(ckpt_dir / OPTIMIZER_FILE)}
            if main
            else None
        )
        set_state_dict(engine.module, engine.optimizer, model_state_dict=cast(Any, full)["model"],
                       optim_state_dict=cast(Any, full)["optimizer"],
                       options=StateDictOptions(full_state_dict=True))  # fmt: skip
    else:
        raise CheckpointError(
            f"{ckpt_dir}: no FSDP state ({DCP_SUBDIR}/ or {OPTIMIZER_FILE}); it was not written by engine='fsdp'"
        )
    return load_torch(ckpt_dir / TRAINER_FILE)


def dcp_failure(exc: BaseException, where: Path) -> str:
    """One line for a failed ``dcp.load``: the first CheckpointError of ours it carries (torch wraps the ranks'
    exceptions in its own, or says only that the metadata read failed), else the error's first line."""
    seen: list[BaseException] = []
    pending: list[BaseException] = [exc]
    while pending:
        e = pending.pop(0)
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, CheckpointError):
            return str(e)
        failures = getattr(e, "failures", None)  # torch's CheckpointException: {rank: exception or traceback}
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                        if isinstance(f[0] if isinstance(f, tuple) else f, BaseException)]  # fmt: skip
        pending += [x for x in (e.__cause__, e.__context__) if x is not None]
    text = " ".join(str(exc).split())
    mine = re.search(r"(/\S+: refused to load .*?|/\S+: (holds|storage entry) .*?)(; rank|$)", text)
    if mine:
        return mine.group(1)
    # The error a rank met (a torch.load of damaged bytes, say), not torch's wrapper with its tracebacks.
    cause = next((e for e in seen if getattr(e, "failures", None) is None), exc)
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    reason = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    fix = "it was damaged or altered: resume from another checkpoint"
    return f"{where}: unreadable sharded checkpoint ({reason}); {fix}"


def broadcast_state(tree: Any, src: int = 0) -> Any:
    """A nested state (dicts, lists, tensors, numbers, strings) as rank ``src`` has it, on every rank: the layout
    goes as JSON, each tensor by ``dist.broadcast`` (no pickle); other ranks pass None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tree
    tensors: list[torch.Tensor] = []

    def strip(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node.detach().cpu().contiguous())
            return {"__tensor__": len(tensors) - 1, "shape": list(node.shape), "dtype": str(node.dtype)[6:]}
        if isinstance(node, dict):
            return {"__dict__": [[strip(k), strip(v)] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return [strip(v) for v in node]
        return node

    layout = broadcast_json(strip(tree) if dist.get_rank() == src else None, src)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def build(node: Any) -> Any:
        if isinstance(node, dict) and "__tensor__" in node:
            i = node["__tensor__"]
            if dist.get_rank() == src:
                buf = tensors[i].to(device)
            else:
                buf = torch.empty(node["shape"], dtype=getattr(torch, node["dtype"]), device=device)
            dist.broadcast(buf, src)
            return buf.cpu()
        if isinstance(node, dict) and "__dict__" in node:
            return {build(k): build(v) for k, v in node["__dict__"]}
        if isinstance(node, list):
            return [build(v) for v in node]
        return node

    return build(layout)
