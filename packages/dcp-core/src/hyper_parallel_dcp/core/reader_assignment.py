"""Read-once + broadcast: replica groups and one byte-balanced reader per replicated shard (SPEC §5).

Ranks send :func:`target_layout`, the coordinator answers (:func:`assign_readers_from_layouts`),
each rank applies its answer (:func:`apply_reader_assignment`); :func:`assign_readers` runs the
three in one process.  Chunk exchanges (SPEC §14: a chunk several ranks need column slices of is
read once, as one run of rows, and its pieces sent) take the same three steps:
:func:`split_reads`, :func:`assign_chunk_exchanges`, :func:`apply_chunk_exchanges`.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence, Union

from .chunks import slice_span
from .metadata import Metadata, MetadataIndex, TensorStorageMetadata
from .planner import LoadItemType, LoadPlan, ReadItem, order_key

__all__ = ["AssignmentReply", "ChunkExchange", "ReaderAssignment", "ReplicaGroup", "SplitRead", "TargetLayout",
           "apply_chunk_exchanges", "apply_reader_assignment", "assign_chunk_exchanges", "assign_readers",
           "assign_readers_from_layouts", "exchanged_reads", "split_reads", "target_layout"]

RankTuple = tuple[int, ...]
# A rank tuple on the wire: a range when its ranks step evenly (every device-mesh group),
# else the tuple.  range(3, 8192, 4) pickles to a few bytes where the tuple takes 6 KB.
PackedRanks = Union[range, RankTuple]
# (fqn, offsets of the local shard, bytes of the shard, digest of its read requests)
TargetEntry = tuple[str, tuple[int, ...], int, int]
TargetLayout = tuple[TargetEntry, ...]
# (fqn, offsets, packed ranks, reader) per multi-member group of the rank, in global order;
# then every multi-member rank tuple of the load, sorted.  None: nothing is replicated.
AssignmentReply = Optional[tuple[tuple[tuple[str, tuple[int, ...], PackedRanks, int], ...], tuple[PackedRanks, ...]]]


@dataclass(frozen=True)
class ReplicaGroup:
    """A replicated local shard: the ranks whose read requests for it are identical, and
    the one of them that reads it from storage (``source``) and broadcasts it."""

    dest_index: MetadataIndex
    ranks: RankTuple
    source: int


# a rank's read of a stored chunk that is not contiguous in it: (fqn, dest offsets, chunk
# offsets, chunk position, chunk sizes, storage_offsets, lengths, stored dtype)
SplitRead = tuple[str, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], tuple[int, ...], tuple[int, ...], Any]
# a piece a chunk's reader sends: (rank, storage_offsets, lengths)
Piece = tuple[int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ChunkExchange:
    """A stored chunk read once: ``reader`` reads rows ``[rows[0], rows[0] + rows[1])`` and sends
    the other members their pieces (``pieces``, on the reader only: sorted ``(rank,
    storage_offsets, lengths)``).  ``shape`` and ``dtype``: the stored chunk's."""

    storage_index: MetadataIndex
    shape: tuple[int, ...]
    dtype: Any
    rows: tuple[int, int]
    reader: int
    pieces: tuple[Piece, ...] = ()


@dataclass(frozen=True)
class ReaderAssignment:
    """A rank's part of the reader assignment (``LoadPlan.planner_data``): its multi-member
    replica ``groups`` in the global order; ``required``, every multi-member rank tuple of the
    load, sorted (the same on every rank); the chunk ``exchanges`` it takes part in."""

    groups: tuple[ReplicaGroup, ...] = ()
    required: tuple[RankTuple, ...] = ()
    exchanges: tuple[ChunkExchange, ...] = ()


def _pack(ranks: RankTuple) -> PackedRanks:
    if len(ranks) > 2:
        step = ranks[1] - ranks[0]
        if step > 0 and ranks[-1] - ranks[0] == step * (len(ranks) - 1) and ranks == tuple(
                range(ranks[0], ranks[-1] + 1, step)):
            return range(ranks[0], ranks[-1] + 1, step)
    return ranks


def target_layout(plan: LoadPlan, metadata: Metadata) -> TargetLayout:
    """Per tensor shard of a rank's plan: FQN, offsets, bytes and a hash of its sorted requests."""
    requests: dict[MetadataIndex, list] = {}  # per shard: [its elements, then its read requests]
    TENSOR, prod = LoadItemType.TENSOR, math.prod
    last: Optional[MetadataIndex] = None
    found: list = []
    for item in plan.items:
        if item.type is not TENSOR:
            continue
        dest = item.dest_index
        if dest is not last:  # a shard's reads are listed together: one lookup per run of them
            last = dest
            found = requests.setdefault(dest, [0])
        found[0] += prod(item.lengths)
        found.append((item.storage_index.offset, item.storage_offsets, item.dest_offsets, item.lengths))
    sd = metadata.state_dict_metadata
    out = []
    for dest, found in requests.items():
        md = sd[dest.fqn]
        itemsize = md.properties.dtype.itemsize if isinstance(md, TensorStorageMetadata) else 1
        reqs = found[1:]
        reqs.sort()
        out.append((dest.fqn, dest.offset or (), found[0] * itemsize, hash(tuple(reqs))))
    return tuple(out)


class _Group:
    __slots__ = ("classes", "key", "nbytes", "ranks", "source")

    def __init__(self, key: TargetEntry, first_class: int) -> None:
        self.key = key
        self.nbytes = key[2]
        self.classes = [first_class]
        self.ranks: RankTuple = ()
        self.source = -1


def assign_readers_from_layouts(layouts: Sequence[TargetLayout]) -> list[AssignmentReply]:
    """The coordinator's step: one :data:`AssignmentReply` per rank (largest shard first, to the
    member with the fewest bytes so far, ties to the lowest rank)."""
    class_of: dict[TargetLayout, int] = {}
    class_ranks: list[list[int]] = []
    for rank, layout in enumerate(layouts):
        c = class_of.setdefault(layout, len(class_ranks))
        if c == len(class_ranks):
            class_ranks.append([])
        class_ranks[c].append(rank)
    class_layouts = list(class_of)
    groups: dict[TargetEntry, _Group] = {}
    get = groups.get
    for c, layout in enumerate(class_layouts):
        for entry in layout:
            group = get(entry)
            if group is None:
                groups[entry] = _Group(entry, c)
            else:
                group.classes.append(c)
    members_of: dict[tuple[int, ...], RankTuple] = {}
    replicated: list[_Group] = []
    # shards only one rank reads, by size: [(rank, group), ...]
    singles: dict[int, list[tuple[int, _Group]]] = {}
    for group in groups.values():
        classes = group.classes
        if len(classes) == 1 and len(class_ranks[classes[0]]) == 1:
            singles.setdefault(group.nbytes, []).append((class_ranks[classes[0]][0], group))
            continue
        key = tuple(classes)
        ranks = members_of.get(key)
        if ranks is None:
            ranks = members_of[key] = tuple(sorted(r for c in classes for r in class_ranks[c]))
        group.ranks = ranks
        replicated.append(group)
    if not replicated:
        return [None] * len(layouts)
    order_keys = {id(g): order_key(MetadataIndex(g.key[0], g.key[1])) for g in replicated}
    replicated.sort(key=lambda g: (-g.nbytes, order_keys[id(g)], g.ranks))
    _choose_readers(replicated, singles, len(layouts), order_keys)

    packed = {ranks: _pack(ranks) for ranks in members_of.values()}
    required = tuple(packed[r] for r in sorted(packed))
    per_class: list[list[tuple]] = [[] for _ in class_layouts]
    for group in sorted(replicated, key=lambda g: (order_keys[id(g)], g.ranks)):
        answer = (group.key[0], group.key[1], packed[group.ranks], group.source)
        for c in group.classes:
            per_class[c].append(answer)
    replies: list[AssignmentReply] = [None] * len(layouts)
    for c, answers in enumerate(per_class):
        reply = (tuple(answers), required)
        for r in class_ranks[c]:
            replies[r] = reply
    return replies


def _choose_readers(replicated: list[_Group], singles: dict[int, list[tuple[int, _Group]]], world: int,
                    order_keys: dict[int, str]) -> None:
    """Set ``source`` of every replicated group (in visiting order); a single-reader shard counts
    for its rank at its place in that order."""
    neg = [-g.nbytes for g in replicated]
    m = len(replicated)
    # bucket j: (nbytes, ranks) of single-reader shards visited just before group j
    buckets: list[list[tuple[int, list[int]]]] = [[] for _ in range(m)]
    tie_keys: Optional[list[tuple[str, RankTuple]]] = None
    for nbytes, members in singles.items():
        lo, hi = bisect.bisect_left(neg, -nbytes), bisect.bisect_right(neg, -nbytes)
        if lo == hi:
            if lo < m:
                buckets[lo].append((nbytes, [rank for rank, _ in members]))
            continue
        if tie_keys is None:
            tie_keys = [(order_keys[id(g)], g.ranks) for g in replicated]
        for rank, g in members:
            # equal size: the global order, then the rank tuple, decides (as in the sort)
            mine = (order_key(MetadataIndex(g.key[0], g.key[1])), (rank,))
            pos = bisect.bisect_left(tie_keys, mine, lo, hi)
            if pos < m:
                buckets[pos].append((nbytes, [rank]))
    assigned = [0] * world
    for group, bucket in zip(replicated, buckets):
        for nbytes, ranks in bucket:
            for rank, count in Counter(ranks).items():
                assigned[rank] += count * nbytes
        # min keeps the first of equal keys and members ascend: ties go to the lowest rank
        reader = min(group.ranks, key=assigned.__getitem__)
        assigned[reader] += group.nbytes
        group.source = reader


def apply_reader_assignment(plan: LoadPlan, reply: AssignmentReply, rank: int) -> LoadPlan:
    """``plan`` with every item's reader and a :class:`ReaderAssignment` (``None``: nothing replicated)."""
    if reply is None:
        return replace(plan, planner_data=ReaderAssignment())
    answers, required_packed = reply
    unpacked: dict[int, RankTuple] = {}

    def unpack(ranks: PackedRanks) -> RankTuple:
        out = unpacked.get(id(ranks))
        if out is None:
            out = unpacked[id(ranks)] = tuple(ranks)
        return out

    source_of: dict[tuple[str, tuple[int, ...]], int] = {}
    groups = []
    for fqn, offsets, ranks, source in answers:
        source_of[(fqn, offsets)] = source
        groups.append(ReplicaGroup(MetadataIndex(fqn, offsets), unpack(ranks), source))
    items = tuple(
        replace(it, source=source_of.get((it.dest_index.fqn, it.dest_index.offset or ()), rank))
        if it.type is LoadItemType.TENSOR else replace(it, source=rank)
        for it in plan.items
    )
    return replace(plan, items=items,
                   planner_data=ReaderAssignment(tuple(groups), tuple(unpack(r) for r in required_packed)))


def assign_readers(all_plans: Sequence[LoadPlan], metadata: Metadata) -> list[LoadPlan]:
    """Every rank's final plan at once: the three steps of the load pipeline in one process."""
    replies = assign_readers_from_layouts([target_layout(p, metadata) for p in all_plans])
    return [apply_reader_assignment(p, reply, r) for r, (p, reply) in enumerate(zip(all_plans, replies))]


def split_reads(plan: LoadPlan, metadata: Metadata) -> tuple[SplitRead, ...]:
    """The tensor reads of ``plan`` that are not contiguous in their stored chunk (what
    :func:`assign_chunk_exchanges` may serve from one contiguous read of the chunk)."""
    sd = metadata.state_dict_metadata
    out = []
    contiguous = _Contiguity()
    for item in plan.items:
        index = item.storage_index
        if item.type is not LoadItemType.TENSOR or len(item.lengths) < 2 or index.index is None:
            continue
        md = sd[index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        sizes = tuple(md.chunks[index.index].sizes)
        if not contiguous(sizes, item.storage_offsets, item.lengths):
            out.append((index.fqn, item.dest_index.offset or (), index.offset or (), index.index, sizes,
                        item.storage_offsets, item.lengths, md.properties.dtype))
    return tuple(out)


def assign_chunk_exchanges(splits: Sequence[Sequence[SplitRead]],
                           replies: Optional[Sequence[AssignmentReply]] = None) -> list[tuple[ChunkExchange, ...]]:
    """The coordinator's step: per rank, the :class:`ChunkExchange` entries it takes part in (chunks
    two ranks or more need non-contiguous pieces of, outside ``replies``' replica groups); readers
    by bytes: largest run first, to the member with the fewest so far, ties to the lowest rank."""
    grouped = {(fqn, offsets) for reply in replies or () if reply is not None for fqn, offsets, _, _ in reply[0]}
    by_chunk: dict[tuple[str, tuple[int, ...]], list] = {}
    for rank, reads in enumerate(splits):
        for fqn, dest, chunk, pos, sizes, offsets, lengths, dtype in reads:
            if (fqn, dest) in grouped:
                continue
            entry = by_chunk.get((fqn, chunk))
            if entry is None:
                entry = by_chunk[(fqn, chunk)] = [pos, sizes, dtype, set()]
            entry[3].add((rank, offsets, lengths))
    chosen = []
    for (fqn, chunk), (pos, sizes, dtype, pieces) in by_chunk.items():
        ranks = sorted({p[0] for p in pieces})
        if len(ranks) < 2:
            continue
        first = min(p[1][0] for p in pieces)
        rows = (first, max(p[1][0] + p[2][0] for p in pieces) - first)
        nbytes = rows[1] * math.prod(sizes[1:]) * dtype.itemsize
        chosen.append((-nbytes, order_key(MetadataIndex(fqn, chunk)), (fqn, chunk, pos, sizes, dtype, rows, ranks,
                                                                      tuple(sorted(pieces)))))
    chosen.sort(key=lambda c: c[:2])
    assigned: Counter = Counter()
    out: list[list[tuple[str, ChunkExchange]]] = [[] for _ in splits]
    for neg_bytes, key, (fqn, chunk, pos, sizes, dtype, rows, ranks, pieces) in chosen:
        reader = min(ranks, key=assigned.__getitem__)
        assigned[reader] -= neg_bytes
        index = MetadataIndex(fqn, chunk, pos)
        out[reader].append((key, ChunkExchange(index, sizes, dtype, rows, reader, pieces)))
        receiving = ChunkExchange(index, sizes, dtype, rows, reader)
        for rank in ranks:
            if rank != reader:
                out[rank].append((key, receiving))
    return [tuple(x for _, x in sorted(entries, key=lambda e: e[0])) for entries in out]


def apply_chunk_exchanges(plan: LoadPlan, exchanges: tuple[ChunkExchange, ...]) -> LoadPlan:
    """``plan`` with its :class:`ReaderAssignment` carrying ``exchanges`` and the reads they
    serve taking their chunk's reader as ``source`` (``plan`` unchanged without any)."""
    if not exchanges:
        return plan
    data = plan.planner_data if isinstance(plan.planner_data, ReaderAssignment) else ReaderAssignment()
    plan = replace(plan, planner_data=replace(data, exchanges=exchanges))
    items = [item if x is None else ReadItem(item.type, item.dest_index, item.dest_offsets, item.storage_index,
                                             item.storage_offsets, item.lengths, x.reader)
             for item, x in exchanged_reads(plan)]
    return replace(plan, items=tuple(items))


def exchanged_reads(plan: LoadPlan) -> Iterator[tuple[ReadItem, Optional[ChunkExchange]]]:
    """Every item of ``plan`` with the :class:`ChunkExchange` that serves it (``None``: read as planned)."""
    data = plan.planner_data if isinstance(plan.planner_data, ReaderAssignment) else ReaderAssignment()
    of_chunk = {(x.storage_index.fqn, x.storage_index.offset): x for x in data.exchanges}
    grouped = {group.dest_index for group in data.groups}
    contiguous = _Contiguity()
    for item in plan.items:
        index = item.storage_index
        x = of_chunk.get((index.fqn, index.offset)) if of_chunk and item.type is LoadItemType.TENSOR else None
        served = x is not None and item.dest_index not in grouped and \
            not contiguous(x.shape, item.storage_offsets, item.lengths)
        yield item, x if served else None


class _Contiguity(dict):
    """Whether a slice ``(offsets, lengths)`` of a chunk of ``sizes`` is one run of it (memoised)."""

    def __call__(self, sizes: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
        key = (sizes, offsets, lengths)
        found = self.get(key)
        if found is None:
            found = self[key] = slice_span(sizes, offsets, lengths)[2]
        return found
