"""Pure scheduling of a read-once + broadcast load: no process group, no tensors.

From its own final load plan (whose ``planner_data`` is the rank's
:class:`~hyper_parallel_dcp.core.reader_assignment.ReaderAssignment`, computed once on the
coordinator) every rank derives, with no extra communication:

* the replica groups the load needs (:func:`required_groups`) — the same sorted list on
  every rank, which is what makes group creation a well-formed collective;
* its own walk (:func:`rank_schedule`): the replicated shards it belongs to in the global
  order ``(fqn, offset)``, then the items nobody waits for (read last);
* where broadcasts are launched and which small shards share one
  (:func:`plan_broadcasts`).

Why the order matters: collectives on one group run in the order they are enqueued, so
every member must enqueue that group's broadcasts in the same order.  All ranks walk
subsequences of one global order and flush batches at positions fixed by that order, so
any two ranks that both launch two broadcasts launch them in the same relative order —
which, with "wait only for the oldest broadcast in flight", cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, ReadItem, order_key, sort_read_items
from hyper_parallel_dcp.core.reader_assignment import ReaderAssignment, ReplicaGroup

__all__ = [
    "BroadcastOp",
    "LaunchStep",
    "RankSchedule",
    "ShardInfo",
    "ShardStep",
    "ShardTask",
    "plan_broadcasts",
    "rank_schedule",
    "replica_groups_of",
    "required_groups",
]

RankTuple = tuple[int, ...]


@dataclass(frozen=True)
class ShardTask:
    """A replicated local shard this rank belongs to.

    ``items`` are this rank's read items for the shard (the reader reads them, the other
    members receive the whole shard by broadcast).
    """

    dest_index: MetadataIndex
    ranks: RankTuple
    source: int
    items: tuple[ReadItem, ...]


@dataclass(frozen=True)
class RankSchedule:
    """One rank's walk: replicated shards in global order, then its own tail reads."""

    shards: tuple[ShardTask, ...]
    tail: tuple[ReadItem, ...]


@dataclass(frozen=True)
class ShardInfo:
    """What batching needs to know about a replicated shard (equal on all its members)."""

    ranks: RankTuple
    source: int
    dtype: Any
    nbytes: int
    device: str = "cpu"


@dataclass(frozen=True)
class BroadcastOp:
    """One broadcast: the shards (indices into the shard list) it ships, from ``source``."""

    ranks: RankTuple
    source: int
    shards: tuple[int, ...]
    batched: bool


@dataclass(frozen=True)
class ShardStep:
    """Handle shard ``index``: the source reads it now; the others have nothing to do."""

    index: int


@dataclass(frozen=True)
class LaunchStep:
    """Launch ``op`` now (after waiting for the oldest broadcast if too many are in flight)."""

    op: BroadcastOp


Step = Union[ShardStep, LaunchStep]


def _assignment(plan: LoadPlan) -> ReaderAssignment:
    data = plan.planner_data
    return data if isinstance(data, ReaderAssignment) else ReaderAssignment()


def replica_groups_of(plan: LoadPlan) -> tuple[ReplicaGroup, ...]:
    """The multi-member replica groups ``plan``'s rank is in (none without an assignment)."""
    return _assignment(plan).groups


def _shard_sort_key(dest: MetadataIndex, ranks: RankTuple) -> tuple[str, RankTuple]:
    # Two groups may share a dest_index (different local shapes at the same offset); they
    # are disjoint, but the rank tuple keeps the order total.
    return order_key(dest), ranks


def rank_schedule(plan: LoadPlan, rank: int,
                  sort_items: Callable[[Iterable[ReadItem]], list[ReadItem]] = sort_read_items) -> RankSchedule:
    """Split ``plan`` (this rank's global plan) into replicated shards and tail reads.

    Replicated shards come from the plan's :class:`ReaderAssignment`, in the global
    order; every other item (unreplicated tensor shards, non-tensor objects) must be read
    by this rank and goes to the tail, sorted by ``sort_items`` (the reader's
    ``StorageReader.sort_items``).  Raises ``ValueError``
    naming the FQN when a tensor item is to be read by another rank outside any group.
    """
    by_dest: dict[MetadataIndex, list[ReadItem]] = {}
    for item in plan.items:
        by_dest.setdefault(item.dest_index, []).append(item)
    shards: list[ShardTask] = []
    grouped: set[MetadataIndex] = set()
    for group in sorted(replica_groups_of(plan), key=lambda g: _shard_sort_key(g.dest_index, g.ranks)):
        dest, ranks, source = group.dest_index, group.ranks, group.source
        if rank not in ranks or source not in ranks:
            raise ValueError(
                f"{dest.fqn!r}: replica group {list(ranks)} of the shard at {list(dest.offset or ())} "
                f"does not contain rank {rank} and its reader {source}"
            )
        items = by_dest.get(dest, [])
        if not items or any(it.type is not LoadItemType.TENSOR for it in items):
            raise ValueError(f"{dest.fqn!r}: rank {rank} is in a replica group for a shard it does not read")
        shards.append(ShardTask(dest, ranks, source, tuple(sort_items(items) if len(items) > 1 else items)))
        grouped.add(dest)
    tail: list[ReadItem] = []
    for dest, items in by_dest.items():
        if dest in grouped:
            continue
        for item in items:
            if item.type is LoadItemType.TENSOR and item.source not in (None, rank):
                raise ValueError(
                    f"{dest.fqn!r}: rank {rank} is told to take the shard at {list(dest.offset or ())} "
                    f"from rank {item.source}, but they share no replica group"
                )
        tail.extend(items)
    return RankSchedule(tuple(shards), tuple(sort_items(tail)))


def required_groups(plan: LoadPlan) -> list[RankTuple]:
    """Every multi-member replica group of the load, sorted by rank tuple.

    The coordinator computed the list once for all ranks and each rank's plan carries it,
    so it is the same on every rank (group creation is a collective of all ranks, even of
    those in no group).
    """
    return sorted(_assignment(plan).required)


def plan_broadcasts(shards: Sequence[ShardInfo], batch_bytes: int) -> list[Step]:
    """The steps of one rank's walk over its replicated shards (given in global order).

    A shard of ``batch_bytes`` or more is broadcast alone right after it is read.
    Smaller shards join the open batch of their ``(group, source, dtype, device)``; a batch is
    launched as soon as it holds exactly ``batch_bytes``, just before a shard that would
    push it past ``batch_bytes`` (so the broadcast overlaps that shard's read), and at the
    end (in key order) for what is left.  ``batch_bytes=0`` disables batching.  Every
    member of a group gets the same sequence of that group's broadcasts.
    """
    steps: list[Step] = []
    open_batches: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}

    def flush(key: tuple) -> None:
        members = open_batches.pop(key)
        open_bytes.pop(key)
        ranks, source = key[0], key[1]
        # A batch of one ships the shard itself: no staging copy.
        steps.append(LaunchStep(BroadcastOp(ranks, source, tuple(members), batched=len(members) > 1)))

    for i, info in enumerate(shards):
        if batch_bytes <= 0 or info.nbytes >= batch_bytes:
            steps.append(ShardStep(i))
            steps.append(LaunchStep(BroadcastOp(info.ranks, info.source, (i,), batched=False)))
            continue
        key = (info.ranks, info.source, str(info.dtype), info.device)
        if key in open_batches and open_bytes[key] + info.nbytes > batch_bytes:
            flush(key)
        steps.append(ShardStep(i))
        open_batches.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + info.nbytes
        if open_bytes[key] == batch_bytes:
            flush(key)
    for key in sorted(open_batches):
        flush(key)
    return steps
