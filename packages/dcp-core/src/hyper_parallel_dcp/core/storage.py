"""Storage interfaces (:class:`StorageWriter`, :class:`StorageReader`) and the one read loop
(:func:`read_items`; the broadcast executor runs its steps, :func:`resolve_destinations` and
:func:`commit_read`)."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Union

import torch

from .metadata import Metadata, MetadataIndex, StorageInfo
from .planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, sort_read_items

__all__ = [
    "ReadDestination",
    "StorageReader",
    "StorageWriter",
    "WriteResult",
    "commit_read",
    "read_items",
    "read_metadata_once",
    "resolve_destinations",
]


@dataclass(frozen=True)
class WriteResult:
    """Where one write item landed: its file's final size and the xxh3 of its safetensors
    header (``None``: not recorded, a reader then parses the header)."""

    index: MetadataIndex
    storage_data: StorageInfo
    file_size: int
    header_digest: str | None = None


class StorageWriter(abc.ABC):
    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Start a new save, optionally into another checkpoint."""

    def set_up_storage_writer(self, *, is_coordinator: bool, rank: int = 0, world_size: int = 1,
                              use_collectives: bool = True) -> None:
        """Called on every rank before planning (and before a plan-cache hit)."""

    def configure_save(self, *, incremental_from: Union[str, os.PathLike, None] = None,
                       compression: Optional[str] = None) -> None:
        """SPEC §14 options: ``incremental_from`` (chunks equal to that checkpoint's are referenced)
        and ``compression`` (``"zstd"``).  Default: ``ValueError`` for either."""
        if incremental_from is not None or compression is not None:
            raise ValueError(f"{type(self).__name__} has no incremental saves or compression (incremental_from="
                             f"{incremental_from!r}, compression={compression!r}); use the filesystem or "
                             "object-store writer")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    @abc.abstractmethod
    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Write every item of ``plan`` (data from ``planner.resolve_data``); may return
        before the data is durable when :meth:`sync_written` waits for it."""

    def sync_written(self) -> None:
        """On every rank: make what ``execute_write`` wrote durable, raising the flush's error."""

    def prepare_finalize(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Before ``finalize_checkpoint`` (same arguments), maybe before the data is durable: the
        commit's work that makes nothing visible (serialise the metadata)."""

    @abc.abstractmethod
    def finalize_checkpoint(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator (or each rank without collectives): commit the checkpoint."""

    def abort(self, error: BaseException) -> None:
        """Called on every rank when the save failed; remove what this save left behind."""


class StorageReader(abc.ABC):
    """Reads a checkpoint.  Abstract: ``reset``, ``load_metadata`` and ``execute_read`` (the
    defaults of ``read_into`` / ``read_object`` run ``execute_read`` on a one-item plan)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None: ...

    @abc.abstractmethod
    def load_metadata(self) -> Metadata:
        """Read the checkpoint's metadata (works without a prior ``reset``)."""

    def location(self) -> Optional[str]:
        """Where the checkpoint is (a path or URL) for error messages; ``None``: unknown."""
        return None

    def read_metadata(self) -> Metadata:
        """The checkpoint's metadata (default: ``load_metadata()``)."""
        return self.load_metadata()

    def read_metadata_payload(self) -> Any:
        """The metadata as something picklable and cheap to send (a file backend: the stored
        bytes); with collectives only the coordinator calls it.  Default: the parsed
        :class:`Metadata`.  After it, :attr:`collectives_required` must be known."""
        return self.read_metadata()

    def metadata_from_payload(self, payload: Any) -> Metadata:
        """The :class:`Metadata` of a :meth:`read_metadata_payload` result (default: itself)."""
        return payload

    def reader_for(self, payload: Any) -> StorageReader:
        """The reader for the format ``payload`` shows (default ``self``), so that no rank
        opens the metadata a second time to tell the format."""
        return self

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        """Called on every rank once the metadata is known."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @abc.abstractmethod
    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` whose ``source`` is this rank (or ``None``)."""

    def sort_items(self, items: Iterable[ReadItem]) -> list[ReadItem]:
        """The order in which this reader reads ``items`` (default: ``sort_read_items``)."""
        return sort_read_items(items)

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``, the item's dtype) with the stored slice;
        may run on a read-ahead thread (touches only the reader and ``dest``)."""
        _execute_alone(self, item, dest)

    def read_object(self, item: ReadItem) -> Any:
        """The non-tensor object ``item`` names, restored; may run on a read-ahead thread.
        The default raises ``RuntimeError`` if ``execute_read`` delivers nothing."""
        return _execute_alone(self, item, None)

    def read_stream(self, reads: Iterable[ReadDestination]) -> Iterator[tuple[ReadItem, Any]]:
        """Read each ``(item, destination or None for an object)`` in order, yielding ``(item,
        filled destination or object)``.  Default: ``read_into`` / ``read_object`` per item."""
        for item, dest in reads:
            if dest is None:
                yield item, self.read_object(item)
            else:
                self.read_into(item, dest)
                yield item, dest

    def reads_are_copies(self) -> bool:
        """Whether reading this checkpoint costs no more than a memory copy (then
        ``HP_DCP_CHUNK_EXCHANGE=auto`` exchanges no chunks)."""
        return False

    @property
    def collectives_required(self) -> bool:
        """False when the metadata came from per-rank files (no global view was written)."""
        return True


class ReadDestination(NamedTuple):
    """A read item and where it goes: a tensor view, or ``None`` for an object."""

    item: ReadItem
    dest: Optional[torch.Tensor]


def read_metadata_once(reader: StorageReader) -> tuple[StorageReader, Metadata]:
    """``(the reader for the checkpoint, its metadata)``, the stored metadata read once."""
    payload = reader.read_metadata_payload()
    reader = reader.reader_for(payload)
    return reader, reader.metadata_from_payload(payload)


def resolve_destinations(planner: LoadPlanner, items: Iterable[ReadItem]) -> Iterator[ReadDestination]:
    """Each item with its destination view from ``planner`` (``None`` for objects), lazily."""
    resolve, byte_io, destination = planner.resolve_tensor, LoadItemType.BYTE_IO, ReadDestination
    for item in items:
        yield destination(item, None if item.type is byte_io else resolve(item))


def commit_read(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand one read result back to ``planner`` (``commit_tensor`` or ``load_bytes``)."""
    if item.type is LoadItemType.BYTE_IO:
        planner.load_bytes(item, value)
    else:
        planner.commit_tensor(item, value)


def read_items(reader: StorageReader, planner: LoadPlanner, items: Iterable[ReadItem]) -> None:
    """The read loop: every item of ``items``, in order, into ``planner``'s targets."""
    # commit_read inlined: a resharded load of small tensors commits thousands of reads
    commit_tensor, load_bytes, byte_io = planner.commit_tensor, planner.load_bytes, LoadItemType.BYTE_IO
    for item, value in reader.read_stream(resolve_destinations(planner, items)):
        if item.type is byte_io:
            load_bytes(item, value)
        else:
            commit_tensor(item, value)


class _OneItemPlanner(LoadPlanner):
    """Receives one item from a reader's ``execute_read`` (the default ``read_into``)."""

    def __init__(self, dest: Optional[torch.Tensor]) -> None:
        self.dest = dest
        self.delivered = False
        self.value: Any = None

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata, *,
                       is_coordinator: bool, rank: int = 0, world_size: int = 1) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        assert self.dest is not None
        return self.dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        assert self.dest is not None
        if tensor is not self.dest:
            self.dest.copy_(tensor)
        self.delivered = True

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.value = value
        self.delivered = True


def _execute_alone(reader: StorageReader, item: ReadItem, dest: Optional[torch.Tensor]) -> Any:
    """Read one item through ``reader.execute_read``: into ``dest``, or returns the object."""
    receiver = _OneItemPlanner(dest)
    reader.execute_read(LoadPlan((replace(item, source=None),)), receiver)
    if not receiver.delivered:
        raise RuntimeError(f"{type(reader).__name__}.execute_read delivered nothing for {item.storage_index.fqn!r} "
                           f"(chunk at {list(item.storage_index.offset or ())})")
    return receiver.value
