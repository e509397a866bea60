"""The public entry points ``save`` and ``load``: the storage from ``checkpoint_id`` through
``core.backends``, then the one pipeline of ``core.pipeline``."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from hyper_parallel_dcp.broadcast import make_read_executor
from hyper_parallel_dcp.core.backends import storage_reader_for, storage_writer_for
from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.planner import LoadPlanner, SavePlanner
from hyper_parallel_dcp.core.standard_planner import StandardLoadPlanner
from hyper_parallel_dcp.core.storage import StorageReader, StorageWriter

__all__ = ["load", "save"]

CheckpointId = Union[str, os.PathLike]


def save(state_dict: dict[str, Any], *, checkpoint_id: Optional[CheckpointId] = None,
         storage_writer: Optional[StorageWriter] = None, planner: Optional[SavePlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, process_group: Optional[Any] = None,
         incremental_from: Optional[CheckpointId] = None, compression: Optional[str] = None) -> Metadata:
    """Save a (sharded) state dict; every rank writes only the shards it owns.

    ``state_dict``: nested dict of DTensors, tensors (replicated), :class:`RaggedShard`,
    ``Stateful`` or picklable leaves; not modified.  With ``use_collectives=True`` every rank
    of the group calls and the coordinator commits ``.metadata`` last (the returned
    :class:`Metadata` is the same on every rank); ``False``: each rank writes
    ``{rank}.metadata``; ``no_dist=True``: this process alone.  ``incremental_from``: a
    checkpoint beside this one whose equal chunks are referenced, not written (SPEC §14).
    ``compression="zstd"`` (filesystem only): chunks zstd-compressed (``storage_fs.compression``).

    Raises ``ValueError`` without a destination or for an ``incremental_from`` elsewhere,
    :class:`UnsupportedPlacementError` for a ``Partial`` DTensor, :class:`ConcurrentSaveError`
    when another save into the same directory runs, :class:`CheckpointException` (on every
    rank) when any rank fails.
    """
    writer = storage_writer_for(checkpoint_id, storage_writer)
    writer.configure_save(incremental_from=incremental_from, compression=compression)
    return save_state_dict(state_dict, writer, planner,
                           process_group=process_group, no_dist=no_dist, use_collectives=use_collectives)


def load(state_dict: dict[str, Any], *, checkpoint_id: Optional[CheckpointId] = None,
         storage_reader: Optional[StorageReader] = None, planner: Optional[LoadPlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, broadcast_replicated_tensors: bool = True,
         broadcast_groups: Optional[dict[tuple[int, ...], Any]] = None, broadcast_batch_bytes: int = 6 * 1024 * 1024,
         verify: Optional[bool] = None, allow_partial_load: bool = False, process_group: Optional[Any] = None) -> None:
    """Load a checkpoint into ``state_dict`` in place; returns ``None``.

    Tensors are filled in place (any layout, the target's shape, a stored dtype cast by the
    copy); non-tensor leaves are replaced, a ``Stateful`` gets ``load_state_dict``.  A key the
    checkpoint lacks raises :class:`MissingKeyError` unless ``allow_partial_load=True``.  A
    torch.distributed.checkpoint directory is read as is.  With collectives, replicated shards
    are read by one rank and broadcast (``broadcast_replicated_tensors``), those below
    ``broadcast_batch_bytes`` batched (0 disables).  ``verify=True`` checks the xxh3 checksum
    of every chunk read; ``None`` keeps the reader's default.

    Raises ``ValueError`` for ``broadcast_groups`` without ``broadcast_replicated_tensors``
    or a negative batch size; :class:`CheckpointNotFoundError` for a missing checkpoint;
    :class:`MissingKeyError`, :class:`MismatchError`, :class:`CorruptCheckpointError` and
    :class:`CheckpointFormatError` naming the key or file.
    """
    if broadcast_groups is not None and not broadcast_replicated_tensors:
        raise ValueError("broadcast_groups is only used with broadcast_replicated_tensors=True")
    if not isinstance(broadcast_batch_bytes, int) or broadcast_batch_bytes < 0:
        raise ValueError(f"broadcast_batch_bytes must be a non-negative int, got {broadcast_batch_bytes!r}")
    reader = storage_reader_for(checkpoint_id, storage_reader, verify=verify)
    if planner is None:
        planner = StandardLoadPlanner(allow_partial_load=allow_partial_load)
    elif allow_partial_load:
        if not hasattr(planner, "allow_partial_load"):
            raise ValueError(f"allow_partial_load=True given but {type(planner).__name__} has no such setting")
        planner.allow_partial_load = True  # type: ignore[attr-defined]
    executor = (make_read_executor(groups=broadcast_groups, batch_bytes=broadcast_batch_bytes)
                if broadcast_replicated_tensors else None)
    load_state_dict(state_dict, reader, planner, process_group=process_group, no_dist=no_dist,
                    use_collectives=use_collectives, read_executor=executor)

