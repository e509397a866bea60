"""Pure scheduling of a read-once + broadcast load (no process group, no tensors).

Every rank walks a subsequence of one global order and flushes batches at positions fixed by
it, so common broadcasts launch in the same order: no deadlock.  :func:`exchange_messages`
packs chunk exchanges into point-to-point messages both sides compute alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, ReadItem, order_key, sort_read_items
from hyper_parallel_dcp.core.reader_assignment import ChunkExchange, ReplicaGroup, assignment_of

__all__ = ["BroadcastOp", "ExchangeMessage", "LaunchStep", "RankSchedule", "ShardInfo", "ShardStep", "ShardTask",
           "assignment_of", "exchange_messages", "plan_broadcasts", "rank_schedule", "replica_groups_of",
           "required_groups"]

RankTuple = tuple[int, ...]


@dataclass(frozen=True)
class ShardTask:
    """A replicated local shard of this rank: its group, reader and this rank's read items."""

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
    """What batching needs to know of a replicated shard (equal on all its members)."""

    ranks: RankTuple
    source: int
    dtype: Any
    nbytes: int
    device: str = "cpu"


@dataclass(frozen=True)
class BroadcastOp:
    """One broadcast from ``source``: the shards (indices into the shard list) it ships."""

    ranks: RankTuple
    source: int
    shards: tuple[int, ...]
    batched: bool


@dataclass(frozen=True)
class ShardStep:
    """Shard ``index`` is due: its reader reads it now."""

    index: int


@dataclass(frozen=True)
class LaunchStep:
    """Launch ``op`` now (after waiting for the oldest broadcast if too many are in flight)."""

    op: BroadcastOp


Step = Union[ShardStep, LaunchStep]


def replica_groups_of(plan: LoadPlan) -> tuple[ReplicaGroup, ...]:
    """The multi-member replica groups ``plan``'s rank is in (none without an assignment)."""
    return assignment_of(plan).groups


def required_groups(plan: LoadPlan) -> list[RankTuple]:
    """Every multi-member replica group of the load, sorted: the same list on every rank."""
    return sorted(assignment_of(plan).required)


def rank_schedule(plan: LoadPlan, rank: int,
                  sort_items: Callable[[Iterable[ReadItem]], list[ReadItem]] = sort_read_items) -> RankSchedule:
    """Split ``plan`` (this rank's final plan) into its replicated shards, from its
    :class:`ReaderAssignment` in the global order, and the other items, read last in
    ``sort_items`` order.  Raises ``ValueError`` naming the FQN when a group lacks this rank
    or its reader, or a tensor item is to be read from a rank outside this rank's groups."""
    by_dest: dict[MetadataIndex, list[ReadItem]] = {}
    for item in plan.items:
        by_dest.setdefault(item.dest_index, []).append(item)
    shards: list[ShardTask] = []
    for group in sorted(replica_groups_of(plan), key=lambda g: (order_key(g.dest_index), g.ranks)):
        dest, ranks, source = group.dest_index, group.ranks, group.source
        if rank not in ranks or source not in ranks:
            raise ValueError(f"{dest.fqn!r}: replica group {list(ranks)} of the shard at {list(dest.offset or ())} "
                             f"does not contain rank {rank} and its reader {source}")
        items = by_dest.get(dest, [])
        if not items or any(it.type is not LoadItemType.TENSOR for it in items):
            raise ValueError(f"{dest.fqn!r}: rank {rank} is in a replica group for a shard it does not read")
        shards.append(ShardTask(dest, ranks, source, tuple(sort_items(items) if len(items) > 1 else items)))
    grouped = {task.dest_index for task in shards}
    tail: list[ReadItem] = []
    for dest, items in by_dest.items():
        if dest in grouped:
            continue
        for item in items:
            if item.type is LoadItemType.TENSOR and item.source not in (None, rank):
                raise ValueError(f"{dest.fqn!r}: rank {rank} is told to take the shard at {list(dest.offset or ())} "
                                 f"from rank {item.source}, but they share no replica group")
        tail.extend(items)
    return RankSchedule(tuple(shards), tuple(sort_items(tail)))


def plan_broadcasts(shards: Sequence[ShardInfo], batch_bytes: int) -> list[Step]:
    """The steps of one rank's walk over its replicated shards (given in global order).

    A shard of ``batch_bytes`` or more is broadcast alone once read; a smaller one joins the
    open batch of its ``(group, source, dtype, device)``, launched when full, before a shard
    that would overflow it, and at the end (``batch_bytes=0``: no batching)."""
    steps: list[Step] = []
    open_batches: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}

    def flush(key: tuple) -> None:
        members = open_batches.pop(key)
        del open_bytes[key]
        steps.append(LaunchStep(BroadcastOp(key[0], key[1], tuple(members), batched=len(members) > 1)))

    for i, info in enumerate(shards):
        if batch_bytes <= 0 or info.nbytes >= batch_bytes:
            steps += [ShardStep(i), LaunchStep(BroadcastOp(info.ranks, info.source, (i,), batched=False))]
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


#: bytes a piece's offset in a message is rounded up to (any dtype views it in place)
_PIECE_ALIGN = 16


@dataclass(frozen=True)
class ExchangeMessage:
    """One point-to-point message of the chunk exchanges: between this rank and ``peer``
    (the receiver when this rank sends, the chunks' reader when it receives), the ``tag``-th
    of the pair, ``nbytes`` long, holding ``pieces``: ``(exchange position, storage_offsets,
    lengths, byte offset)``, each the stored slice in row-major order."""

    peer: int
    tag: int
    nbytes: int
    pieces: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]


def exchange_messages(exchanges: Sequence[ChunkExchange], rank: int,
                      received: Sequence[Sequence[tuple[tuple[int, ...], tuple[int, ...]]]],
                      batch_bytes: int) -> tuple[list[ExchangeMessage], list[ExchangeMessage]]:
    """``(messages rank sends, messages it receives)`` for its ``exchanges`` (global order).
    ``received[i]``: the sorted ``(storage_offsets, lengths)`` this rank takes from exchange
    ``i``.  Pieces between two ranks go in order, in messages of at most ``batch_bytes``."""
    pairs: dict[tuple[bool, int], list[tuple[int, tuple[int, ...], tuple[int, ...], int]]] = {}
    for i, x in enumerate(exchanges):
        itemsize = x.dtype.itemsize
        if x.reader == rank:
            for peer, offsets, lengths in x.sent():
                if peer != rank:
                    pairs.setdefault((True, peer), []).append((i, offsets, lengths, math.prod(lengths) * itemsize))
        else:
            for offsets, lengths in received[i]:
                pairs.setdefault((False, x.reader), []).append((i, offsets, lengths, math.prod(lengths) * itemsize))
    sends: list[ExchangeMessage] = []
    receives: list[ExchangeMessage] = []
    for (sending, peer), pieces in sorted(pairs.items()):
        out = sends if sending else receives
        messages: list[list] = [[]]
        sizes = [0]
        for i, offsets, lengths, nbytes in pieces:
            if messages[-1] and sizes[-1] + nbytes > batch_bytes:
                messages.append([])
                sizes.append(0)
            messages[-1].append((i, offsets, lengths, sizes[-1]))
            sizes[-1] = -(-(sizes[-1] + nbytes) // _PIECE_ALIGN) * _PIECE_ALIGN
        out += [ExchangeMessage(peer, tag, size, tuple(packed))
                for tag, (packed, size) in enumerate(zip(messages, sizes))]
    return sends, receives
