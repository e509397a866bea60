"""``torch.distributed.checkpoint`` storage plugins that write and read this library's format (SPEC §15).

``torch.distributed.checkpoint.save(sd, storage_writer=StorageWriter(path))``, its
``async_save`` (thread and process executors) and ``load(sd, storage_reader=StorageReader(path))``
keep torch's planners; what lands on disk is ours: safetensors shards, the JSON
``.metadata`` with a checksum per chunk, the atomic commit of :class:`FileSystemWriter`.
A checkpoint written through the plugin loads with :func:`hyper_parallel_dcp.load` into
any layout, and one written by :func:`hyper_parallel_dcp.save` (or by torch's own
``FileSystemWriter``) loads through :class:`StorageReader`.

The writer translates torch's write items into ours and runs :class:`FileSystemWriter`
(the same file writer and commit as a native save); the reader translates our metadata
into torch's and reads with :class:`FileSystemReader`'s batched reads.  Benchmark rows
``plugin save`` / ``plugin load`` of ``hp-dcp-bench io`` (docs/integrations.md).
"""

from __future__ import annotations

import functools
import io
import math
import os
import uuid
from dataclasses import replace
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint import planner as tplan
from torch.distributed.checkpoint import storage as tstorage
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from hyper_parallel_dcp.core import metadata as ours
from hyper_parallel_dcp.core.gc_pause import gc_paused
from hyper_parallel_dcp.core.metadata import MetadataIndex, StorageInfo
from hyper_parallel_dcp.core.objects import serialize_object
from hyper_parallel_dcp.core.pipeline import attach_results
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem, SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.storage import ReadDestination, WriteResult
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter, storage_reader_for_path
from hyper_parallel_dcp.storage_fs.torch_dcp import metadata_from_torch, metadata_to_torch

__all__ = ["CachedSavePlanner", "StorageReader", "StorageWriter", "load", "metadata_from_torch", "metadata_to_torch", "save"]

PathLike = Union[str, os.PathLike]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _index(index: tmd.MetadataIndex) -> MetadataIndex:
    return MetadataIndex(index.fqn, None if index.offset is None else tuple(index.offset), index.index)


def _write_item(item: tplan.WriteItem) -> WriteItem:
    if item.type is tplan.WriteItemType.BYTE_IO:
        return WriteItem(MetadataIndex(item.index.fqn), WriteItemType.BYTE_IO)
    data = item.tensor_data
    assert data is not None, f"{item.index.fqn!r}: a tensor write item without tensor data"
    sizes = tuple(data.chunk.sizes)
    dtype = data.properties.dtype
    return WriteItem(MetadataIndex(item.index.fqn, tuple(data.chunk.offsets)), WriteItemType.TENSOR, sizes,
                     tuple(data.size), ours.dtype_name(dtype), math.prod(sizes) * dtype.itemsize)


def _leaves(planner: Any, base: type, *methods: str) -> Optional[dict[str, Any]]:
    """``planner``'s flat state dict where it finds tensors as torch's ``base`` planner does
    (none of ``methods`` overridden), so that :func:`_local` may look them up itself."""
    cls = type(planner)
    return planner.state_dict if all(getattr(cls, m, None) is getattr(base, m) for m in methods) else None


def _local(leaves: Optional[dict[str, Any]], fqn: str) -> Optional[torch.Tensor]:
    """What torch's ``find_state_dict_object`` returns for a plain tensor or a DTensor leaf
    (its local tensor), without ``to_local`` through autograd; ``None``: ask torch's planner.
    Rows ``plugin save`` / ``plugin load``, small case: 17 ms of a 2000-chunk save's
    ``resolve_data`` and 20 ms of its load's ``resolve_tensor`` (one process)."""
    leaf = None if leaves is None else leaves.get(fqn)
    if type(leaf) is torch.Tensor:
        return leaf
    if type(leaf) is DTensor and type(leaf._local_tensor) is torch.Tensor and not _partial(leaf._spec.placements):
        return leaf._local_tensor
    return None


@functools.lru_cache(maxsize=64)
def _partial(placements: tuple[Any, ...]) -> bool:  # torch refuses to save or load a Partial DTensor
    return any(p.is_partial() for p in placements)


class _TorchPlannerData:
    """torch's planner as the data source ``write_rank_files`` reads (``resolve_data``,
    ``object_bytes``): torch serialises objects itself, and those bytes are stored as is.

    Each item is resolved once: ``write_rank_files`` asks twice (to write, then to hash
    after the fsyncs started), and torch's ``resolve_data`` costs ~8 µs a DTensor chunk
    (``to_local`` through autograd), which :func:`_local` skips for torch's own planner."""

    resolved_data_stable = True  # torch's planners return views of the (staged) state dict

    def __init__(self, planner: tplan.SavePlanner, items: dict[MetadataIndex, tplan.WriteItem]) -> None:
        self._planner = planner
        self._items = items
        self._resolved: dict[MetadataIndex, Any] = {}
        self._leaves = _leaves(planner, DefaultSavePlanner, "resolve_data", "lookup_object", "transform_object")

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._resolved.get(item.index)
        if data is None:
            data = _local(self._leaves, item.index.fqn) if item.type is WriteItemType.TENSOR else None
            if data is None:
                data = self._planner.resolve_data(self._items[item.index])
            data = data.detach() if isinstance(data, torch.Tensor) else data
            if isinstance(data, torch.Tensor):  # objects are read once; a BytesIO is not read twice
                self._resolved[item.index] = data
        return data

    def object_bytes(self, item: WriteItem) -> bytes:
        data = self.resolve_data(item)
        return data.getvalue() if isinstance(data, io.BytesIO) else serialize_object(data)


class StorageWriter(tstorage.StorageWriter):
    """torch's ``StorageWriter`` interface over :class:`FileSystemWriter`: our files, torch's plans.

    ``sync_files=False`` skips the fsyncs (throwaway checkpoints only).  A multi-rank save
    with torch's ``use_collectives=False`` writes ``{rank}.metadata`` files, as a native one.
    """

    def __init__(self, path: Optional[PathLike] = None, *, sync_files: bool = True) -> None:
        super().__init__()
        self._fs = FileSystemWriter(path, sync_files=sync_files)
        self._finishes = True  # whether this rank's finish() commits (it then fsyncs there)

    @property
    def checkpoint_id(self) -> Optional[str]:
        return None if self._fs.path is None else str(self._fs.path)

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        self._fs.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, use_collectives: bool = True,
                              **kwargs: Any) -> None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._fs.set_up_storage_writer(is_coordinator=is_coordinator, rank=rank, world_size=world_size,
                                       use_collectives=use_collectives)
        self._finishes = is_coordinator or not use_collectives

    def prepare_local_plan(self, plan: tplan.SavePlan) -> tplan.SavePlan:
        self._fs.prepare_local_plan(SavePlan(()))  # the coordinator takes the save lock
        return plan

    def prepare_global_plan(self, plans: list[tplan.SavePlan]) -> list[tplan.SavePlan]:
        save_id = uuid.uuid4().hex  # names the staging directory every rank writes into
        return [replace(plan, storage_data=save_id) for plan in plans]

    @gc_paused()  # as a native save: no collection among the millions of small objects
    def write_data(self, plan: tplan.SavePlan, planner: tplan.SavePlanner) -> Future:
        items: dict[MetadataIndex, tplan.WriteItem] = {}
        mine = []
        for item in plan.items:
            translated = _write_item(item)
            items[translated.index] = item
            mine.append(translated)
        save_plan = SavePlan(tuple(mine), save_id=plan.storage_data if isinstance(plan.storage_data, str) else None)
        try:
            results = self._fs.execute_write(save_plan, _TorchPlannerData(planner, items))  # type: ignore[arg-type]
            if not self._finishes:  # torch commits once every rank's write_data returned; the
                self._fs.sync_written()  # committing rank's fsyncs overlap the gather of results
        except BaseException as exc:
            self._fs.abort(exc)
            raise
        # torch passes the results to finish() unread, gathered pickled: one list of plain tuples
        # a rank pickles and unpickles in 2 ms for 2000 chunks (small case), its WriteResults in 16
        return _done([[(r.index.fqn, r.index.offset, s.relative_path, s.offset, s.length, s.checksum, s.key,
                        r.file_size, r.header_digest) for r in results for s in (r.storage_data,)]])

    @gc_paused()
    def finish(self, metadata: tmd.Metadata, results: list[list[Any]]) -> None:
        written = [[WriteResult(MetadataIndex(fqn, offset), StorageInfo(path, start, length, checksum, key), size, digest)
                    for fqn, offset, path, start, length, checksum, key, size, digest in rank_results[0]]
                   for rank_results in results]
        self._fs.finalize_checkpoint(attach_results(metadata_from_torch(metadata), written), written)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return "://" not in str(checkpoint_id)  # a local path


class StorageReader(tstorage.StorageReader):
    """torch's ``StorageReader`` interface over :class:`FileSystemReader` (or, for a torch
    DCP directory, :class:`TorchDCPReader`): our reads, torch's plans.  ``verify=True``
    checks the stored checksum of every chunk and object read."""

    def __init__(self, path: Optional[PathLike] = None, *, verify: bool = False) -> None:
        super().__init__()
        self.path = path
        self.verify = verify
        self._fs: Optional[FileSystemReader] = None
        self._metadata: Optional[ours.Metadata] = None

    @property
    def checkpoint_id(self) -> Optional[str]:
        return None if self.path is None else str(self.path)

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._fs = None
        self._metadata = None

    def _reader(self) -> FileSystemReader:
        if self._fs is None:
            if self.path is None:
                raise ValueError("torch_compat.StorageReader has no checkpoint path: pass checkpoint_id or a path")
            self._fs = storage_reader_for_path(self.path, self.verify)
        return self._fs

    @gc_paused()
    def read_metadata(self) -> tmd.Metadata:
        self._metadata = self._reader().load_metadata()
        return metadata_to_torch(self._metadata)

    def set_up_storage_reader(self, metadata: tmd.Metadata, is_coordinator: bool, *args: Any, rank: int = 0,
                              **kwargs: Any) -> None:
        if self._metadata is None:
            self.read_metadata()
        assert self._metadata is not None
        self._reader().set_up_storage_reader(self._metadata, is_coordinator=is_coordinator, rank=rank)

    def prepare_local_plan(self, plan: tplan.LoadPlan) -> tplan.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[tplan.LoadPlan]) -> list[tplan.LoadPlan]:
        return plans

    @gc_paused()
    def read_data(self, plan: tplan.LoadPlan, planner: tplan.LoadPlanner) -> Future:
        reader = self._reader()
        theirs: dict[int, tplan.ReadItem] = {}
        mine = []
        byte_io = tplan.LoadItemType.BYTE_IO
        for item in plan.items:
            translated = ReadItem(LoadItemType.BYTE_IO if item.type is byte_io else LoadItemType.TENSOR,
                                  _index(item.dest_index), tuple(item.dest_offsets), _index(item.storage_index),
                                  tuple(item.storage_offsets), tuple(item.lengths))
            theirs[id(translated)] = item
            mine.append(translated)
        ordered = reader.sort_items(mine)
        tensors = []
        for item in ordered:
            if item.type is LoadItemType.BYTE_IO:  # torch's planner unpickles: it gets the stored bytes
                planner.load_bytes(theirs[id(item)], io.BytesIO(reader.read_object_bytes(item)[0]))
            else:
                tensors.append(item)
        leaves = _leaves(planner, DefaultLoadPlanner, "resolve_tensor", "lookup_tensor", "transform_tensor")
        reads = (ReadDestination(item, _destination(planner, leaves, theirs[id(item)])) for item in tensors)
        commits = type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor  # torch's does nothing
        for item, value in reader.read_stream(reads):
            if commits:
                planner.commit_tensor(theirs[id(item)], value)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return "://" not in str(checkpoint_id)  # a local path


def _destination(planner: tplan.LoadPlanner, leaves: Optional[dict[str, Any]], item: tplan.ReadItem) -> torch.Tensor:
    local = _local(leaves, item.dest_index.fqn)
    if local is None:
        return planner.resolve_tensor(item).detach()
    return planner.transform_tensor(item, local).detach()  # type: ignore[attr-defined]


class CachedSavePlanner(DefaultSavePlanner):
    """torch's ``DefaultSavePlanner(enable_plan_caching=True)``, unchanged but for its name:
    torch keys its class-level plan cache by the planner's class name, and a final plan
    cached for torch's ``FileSystemWriter`` (its ``storage_data`` a file prefix) must not be
    handed to :class:`StorageWriter` (a save id), nor the other way round."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "enable_plan_caching": True})


def save(state_dict: dict[str, Any], path: PathLike, *, planner: Optional[tplan.SavePlanner] = None,
         **kwargs: Any) -> tmd.Metadata:
    """torch's ``save`` through :class:`StorageWriter`, as the integrations call it.

    Two things a user of torch's API may keep too: torch's own ``DefaultSavePlanner`` with
    its public ``enable_plan_caching=True`` (:class:`CachedSavePlanner`; an unchanged plan
    is neither gathered nor planned globally again), and the cyclic GC paused across the
    call, as a native save does (its collections inside torch's pickling of the plans and
    metadata took ~500 ms of a 1.5 s small save).  Row ``plugin save_cached_plan`` of
    ``hp-dcp-bench io``.
    """
    with gc_paused():
        return tdcp.save(state_dict, storage_writer=StorageWriter(path),
                         planner=planner if planner is not None else CachedSavePlanner(), **kwargs)


def load(state_dict: dict[str, Any], path: PathLike, **kwargs: Any) -> None:
    """torch's ``load`` through :class:`StorageReader` with the cyclic GC paused (row ``plugin load_gc_paused``)."""
    with gc_paused():
        tdcp.load(state_dict, storage_reader=StorageReader(path), **kwargs)
