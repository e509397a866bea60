"""Plan types (plain frozen data), the global read order and the planner interfaces."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Optional, Sequence

import torch

from .metadata import Metadata, MetadataIndex, chunk_key
from .objects import serialize_object

__all__ = [
    "LoadItemType",
    "LoadPlan",
    "LoadPlanner",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "WriteItem",
    "WriteItemType",
    "order_key",
    "sort_read_items",
]


class WriteItemType(Enum):
    TENSOR = "tensor"
    BYTE_IO = "bytes"


class LoadItemType(Enum):
    TENSOR = "tensor"
    BYTE_IO = "bytes"


def order_key(index: MetadataIndex) -> str:
    """The global total order ``(fqn, offset)`` used for writing, reading and broadcasting."""
    return chunk_key(index.fqn, index.offset or ())


@dataclass(frozen=True)
class WriteItem:
    """One item a rank writes: a tensor chunk (global box) or a pickled object; ``digest``: an
    object's content digest (differing copies are stored per rank; ``None``: dedup by key)."""

    index: MetadataIndex
    type: WriteItemType
    sizes: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None
    dtype: str | None = None
    nbytes: int = 0
    digest: str | None = None


@dataclass(frozen=True)
class SavePlan:
    """A rank's write items (a tuple, or :class:`~.plan_columns.WriteColumns`: both iterate,
    index and compare alike); ``save_id`` names the save (it picks the staging area)."""

    items: Sequence[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    save_id: str | None = None


@dataclass(frozen=True)
class ReadItem:
    """Copy ``lengths`` elements from a stored chunk (``storage_index``, at ``storage_offsets``)
    into a local shard (``dest_index``, at ``dest_offsets``); ``source``: the reading rank
    (``None``: this rank)."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: tuple[int, ...]
    storage_index: MetadataIndex
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    source: int | None = None


@dataclass(frozen=True)
class LoadPlan:
    """A rank's read items.  ``planner_data`` of a final plan with read-once + broadcast is
    the rank's :class:`~hyper_parallel_dcp.core.reader_assignment.ReaderAssignment`."""

    items: tuple[ReadItem, ...]
    storage_data: Any = None
    planner_data: Any = None


def sort_read_items(items: Iterable[ReadItem]) -> list[ReadItem]:
    """``items`` in the global read order (destination shard, stored chunk, offsets): file
    order for the filesystem layout, and the order a broadcast load ships shards."""
    # (fqn, offsets) tuples sort as their chunk keys (``order_key``) without formatting them
    return sorted(items, key=lambda it: (it.dest_index.fqn, it.dest_index.offset or (), it.storage_index.fqn,
                                         it.storage_index.offset or (), it.storage_offsets))


class SavePlanner(abc.ABC):
    """Decides what each rank writes: ``set_up_planner`` → (``lookup_cached_plan``) →
    ``create_local_plan`` → ``create_global_plan`` on the coordinator → ``finish_plan`` →
    ``resolve_data`` per item.  ``cache_hit``: whether this save reused a cached plan."""

    cache_hit: bool = False

    #: Whether every tensor ``resolve_data`` returns keeps its values until ``execute_write``
    #: returns (a writer may then batch and hash them after writing).
    resolved_data_stable: bool = False

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], *, is_coordinator: bool, rank: int = 0,
                       world_size: int = 1, use_collectives: bool = True) -> None:
        """Receive the *flattened* state dict (FQN → leaf)."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan: ...

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]: ...

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan: ...

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> Any:
        """The tensor (a view of shape ``write_item.sizes``) or object to write."""

    def object_bytes(self, write_item: WriteItem) -> bytes:
        """The stored bytes of a non-tensor item: ``torch.save`` of :meth:`resolve_data`."""
        return serialize_object(self.resolve_data(write_item))

    def lookup_cached_plan(self) -> Optional[tuple[SavePlan, Optional[Metadata]]]:
        """A cached ``(final plan, metadata)`` that lets the save skip planning, or ``None``."""
        return None

    def cache_plan(self, final_plan: SavePlan, metadata: Optional[Metadata]) -> None:
        """Remember a final plan (and, on the coordinator, the metadata) for later saves."""

    def cache_token(self) -> Any:
        """What must be equal on every rank for the cached plans to serve (default ``None``)."""
        return None


class LoadPlanner(abc.ABC):
    """Decides what each rank reads: ``set_up_planner`` → ``create_local_plan`` →
    ``finish_plan`` → ``resolve_tensor`` / ``commit_tensor`` / ``load_bytes`` during the reads."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata, *,
                       is_coordinator: bool, rank: int = 0, world_size: int = 1) -> None: ...

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan: ...

    @abc.abstractmethod
    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination view (shape ``read_item.lengths``) that the read fills."""

    def resolve_region(self, read_item: ReadItem) -> tuple[torch.Tensor, Optional[int], tuple[int, ...]]:
        """``(view, None, ())`` with ``resolve_tensor``'s view, or ``(tensor, storage offset,
        strides)`` whose ``as_strided(read_item.lengths, ...)`` is it (the reader fills it;
        ``commit_tensor`` is not called)."""
        return self.resolve_tensor(read_item), None, ()

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Receive a restored non-tensor object."""

    def resolve_shard(self, dest_index: MetadataIndex) -> torch.Tensor:
        """The whole local shard named by ``dest_index`` (what a broadcast ships)."""
        raise NotImplementedError
