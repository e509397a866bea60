"""Storage interfaces: how a plan becomes bytes somewhere and back, and the one read loop.

A backend subclasses :class:`StorageWriter` / :class:`StorageReader` (the optional hooks
have defaults).  Every load reads through :func:`read_items` (resolve each destination,
``read_stream``, commit); the broadcast executor runs the same steps
(:func:`resolve_destinations`, :func:`commit_read`).
"""

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
    """Where one write item landed; ``file_size`` is the final size of its file and
    ``header_digest`` the xxh3 of its safetensors header bytes (``None``: not recorded,
    e.g. an objects file; a reader then parses the header)."""

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
        """SPEC §14 options of this writer's saves: ``incremental_from`` (a chunk equal to the
        same chunk of that checkpoint is referenced, not written) and ``compression``
        (``"zstd"``).  Default: ``ValueError`` for either, this writer has neither."""
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
        """Make what ``execute_write`` wrote durable, raising the flush's error (called on
        every rank; the commit follows its return everywhere).  Default: nothing, the
        data was durable when ``execute_write`` returned."""

    def prepare_finalize(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator (or each rank without collectives), before ``finalize_checkpoint``
        with the same arguments, possibly before the data is durable: the commit's work
        that makes nothing visible (serialise the metadata).  Default: nothing."""

    @abc.abstractmethod
    def finalize_checkpoint(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator (or each rank without collectives): commit the checkpoint."""

    def abort(self, error: BaseException) -> None:
        """Called on every rank when the save failed; remove what this save left behind."""


class StorageReader(abc.ABC):
    """Reads a checkpoint.

    Abstract: ``reset``, ``load_metadata`` and ``execute_read``.  A reader that reads one item
    at a time also overrides ``read_into`` and ``read_object`` and implements ``execute_read``
    as ``read_items(self, planner, self.sort_items(...))`` (the defaults of ``read_into`` /
    ``read_object`` run ``execute_read`` on a one-item plan).
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None: ...

    @abc.abstractmethod
    def load_metadata(self) -> Metadata:
        """Read the checkpoint's metadata (works without a prior ``reset``)."""

    _known_metadata: Optional[Metadata] = None

    def location(self) -> Optional[str]:
        """Where the checkpoint is (a path or URL) for error messages; ``None``: unknown."""
        return None

    def use_metadata(self, metadata: Metadata) -> None:
        """Serve ``metadata`` instead of reading it again on every load through this reader."""
        self._known_metadata = metadata

    def read_metadata(self) -> Metadata:
        """The metadata given to ``use_metadata``, else ``load_metadata()``."""
        return self._known_metadata if self._known_metadata is not None else self.load_metadata()

    def read_metadata_payload(self) -> Any:
        """The metadata for the whole job, something picklable and cheap to send (a file
        backend returns the stored bytes): with collectives only the coordinator calls
        this and every rank passes the broadcast result to :meth:`metadata_from_payload`.
        Default: the parsed :class:`Metadata`.  Raises as :meth:`read_metadata`; after
        it, :attr:`collectives_required` must be known.
        """
        return self.read_metadata()

    def metadata_from_payload(self, payload: Any) -> Metadata:
        """On every rank, the :class:`Metadata` of :meth:`read_metadata_payload`'s result
        (raise :class:`CheckpointFormatError` naming the source).  Default: ``payload``."""
        return payload

    def reader_for(self, payload: Any) -> StorageReader:
        """On every rank, the reader of the checkpoint whose :meth:`read_metadata_payload`
        is ``payload``: ``self``, or one for the other format the stored bytes show (a
        directory's reader and a torch DCP pickle), so that no rank opens the metadata a
        second time to tell the format.  Default: ``self``."""
        return self

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        """Called on every rank once the metadata is known: a reader keeps what its reads
        need from here (with collectives only the coordinator called ``load_metadata``)."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @abc.abstractmethod
    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` whose ``source`` is this rank (or ``None``)."""

    def sort_items(self, items: Iterable[ReadItem]) -> list[ReadItem]:
        """The order in which this reader reads ``items`` (a new list), a pure function of
        ``items``.  Default: the global order (``core.planner.sort_read_items``)."""
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
        """Read each ``(item, destination or None for an object)`` in the order given,
        yielding ``(item, filled destination or object)``; touches only the reader and the
        destinations.  Default: one item at a time (``read_into`` / ``read_object``)."""
        for item, dest in reads:
            if dest is None:
                yield item, self.read_object(item)
            else:
                self.read_into(item, dest)
                yield item, dest

    def reads_are_copies(self) -> bool:
        """Whether reading this checkpoint's bytes costs this rank no more than a memory copy
        (a local cache already holds them): then a chunk that several ranks need column slices
        of is cheaper read by each than sent over the process group (``HP_DCP_CHUNK_EXCHANGE``
        auto).  Default: ``False``."""
        return False

    @property
    def collectives_required(self) -> bool:
        """False when the metadata came from per-rank files (no global view was written)."""
        return True


# ------------------------------------------------------------------------- the read loop
class ReadDestination(NamedTuple):
    """A read item and where it goes: a tensor view, or ``None`` for an object."""

    item: ReadItem
    dest: Optional[torch.Tensor]


def read_metadata_once(reader: StorageReader) -> tuple[StorageReader, Metadata]:
    """One process's metadata read: ``(the reader for the checkpoint, its metadata)``, the
    stored metadata read once (:meth:`StorageReader.reader_for` picks the reader)."""
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
    """The read loop: every item of ``items``, in the order given, into ``planner``'s
    targets; raises what the reader or the planner raises, at the first failure."""
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

    def create_global_plan(self, all_plans: list[LoadPlan]) -> list[LoadPlan]:
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
    # source=None: "this rank", whatever rank the reader was set up with.
    reader.execute_read(LoadPlan((replace(item, source=None),)), receiver)
    if not receiver.delivered:
        raise RuntimeError(f"{type(reader).__name__}.execute_read delivered nothing for {item.storage_index.fqn!r} "
                           f"(chunk at {list(item.storage_index.offset or ())})")
    return receiver.value
