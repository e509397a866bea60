"""Read-once loading (SPEC §5, §14): a stored byte several ranks need is read by one of them
and sent to the others.  Two kinds of share, one assignment: a replicated shard (the ranks
whose read requests for it are identical: a replica group, one byte-balanced reader, a
broadcast) and a chunk exchange (a stored chunk several ranks need non-contiguous pieces of,
read once as one run of its rows by one member, its pieces sent point to point).

Each rank sends :func:`read_layout`, the coordinator answers (:func:`assign_reads`), each
rank applies its answer (:func:`apply_assignment`); :func:`assign_readers` runs the three in
one process.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from .chunks import slice_span
from .metadata import ChunkTable, Metadata, MetadataIndex, TensorStorageMetadata, chunk_key
from .planner import LoadItemType, LoadPlan, ReadItem, order_key

__all__ = ["AssignmentReply", "ChunkExchange", "ExchangeReply", "ReadLayout", "ReaderAssignment", "ReplicaGroup",
           "Reply", "SplitReads", "TargetLayout", "apply_assignment", "assign_reads", "assign_readers",
           "assignment_of", "exchanged_reads", "read_layout"]

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


@dataclass(frozen=True, eq=False)
class SplitReads:
    """A rank's tensor reads that are not contiguous in their stored chunk, as columns (what the
    coordinator gathers: no object per read).  ``table``: int64, a row per read, ``[chunk, row
    bytes, dest, item, offsets..., lengths...]``: ``chunk`` the stored chunk's place in the
    load's global order of chunks (every rank numbers them alike from the shared metadata),
    ``row bytes`` the bytes of one row of it, ``dest`` the read's target shard's place in
    ``dests`` (``(fqn, offsets)``), ``item`` the read's place in the plan's items; its storage
    offsets and lengths padded with 0 and 1 to the widest read's dimensions."""

    table: np.ndarray
    dests: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __len__(self) -> int:
        return len(self.table)


_CHUNK, _ROW_BYTES, _DEST, _ITEM = range(4)  # the columns of SplitReads.table before the boxes
#: a rank's chunk exchanges (:func:`assign_reads`): per row of its :class:`SplitReads`, ``[reader
#: (-1: read as planned), first row, rows]`` of the chunk; then the pieces of the chunks it reads,
#: ``[chunk, rank, offsets..., lengths...]`` rows sorted (int64 arrays both)
ExchangeReply = tuple[np.ndarray, np.ndarray]
#: what a rank sends (:func:`read_layout`), and the coordinator's answer to it (:func:`assign_reads`)
ReadLayout = tuple[TargetLayout, SplitReads]
Reply = tuple[AssignmentReply, Optional[ExchangeReply]]


@dataclass(frozen=True)
class ChunkExchange:
    """A stored chunk read once: ``reader`` reads rows ``[rows[0], rows[0] + rows[1])`` and sends
    the other members their pieces (``pieces``, on the reader only: an int64 array, a row
    ``[rank, storage_offsets..., lengths...]`` per piece, sorted).  ``shape`` and ``dtype``: the
    stored chunk's."""

    storage_index: MetadataIndex
    shape: tuple[int, ...]
    dtype: Any
    rows: tuple[int, int]
    reader: int
    pieces: Optional[np.ndarray] = field(default=None, compare=False)

    def sent(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``pieces`` as sorted ``(rank, storage_offsets, lengths)`` (none off the reader)."""
        if self.pieces is None:
            return []
        n = len(self.shape)
        return [(row[0], tuple(row[1:1 + n]), tuple(row[1 + n:])) for row in self.pieces.tolist()]


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


def read_layout(plan: LoadPlan, metadata: Metadata) -> ReadLayout:
    """What a rank sends the coordinator, from one pass over ``plan``: per tensor shard its FQN,
    offsets, bytes and a hash of its sorted read requests (equal entries: a replica group),
    and its :class:`SplitReads` (the reads not contiguous in their stored chunk, which a chunk
    exchange may serve from one contiguous read of the chunk)."""
    sd = metadata.state_dict_metadata
    chunks_of = _ChunksOf(sd, places=True)
    contiguous = _contiguity()
    requests: dict[MetadataIndex, list] = {}  # per shard: [its elements, then its read requests]
    dest_of: dict[tuple[str, tuple[int, ...]], int] = {}
    rows: list[tuple[int, ...]] = []
    TENSOR, prod = LoadItemType.TENSOR, math.prod
    last: Optional[MetadataIndex] = None
    found: list = []
    width, dest = 0, -1
    for position, item in enumerate(plan.items):
        if item.type is not TENSOR:
            continue
        index, lengths = item.storage_index, item.lengths
        if item.dest_index is not last:  # a shard's reads are listed together: one lookup per run of them
            last, dest = item.dest_index, -1
            found = requests.setdefault(last, [0])
        found[0] += prod(lengths)
        found.append((index.offset, item.storage_offsets, item.dest_offsets, lengths))
        if len(lengths) < 2 or index.index is None:
            continue
        sizes, dtype, places = chunks_of[index.fqn]
        chunk_sizes = sizes[index.index]
        if contiguous(chunk_sizes, item.storage_offsets, lengths):
            continue
        if dest < 0:
            dest = dest_of.setdefault((last.fqn, last.offset or ()), len(dest_of))
        rows.append((places[index.index], prod(chunk_sizes[1:]) * dtype.itemsize, dest, position,
                     *item.storage_offsets, *lengths))
        width = max(width, len(lengths))
    targets = []
    for shard, found in requests.items():
        md = sd[shard.fqn]
        itemsize = md.properties.dtype.itemsize if isinstance(md, TensorStorageMetadata) else 1
        reqs = found[1:]
        reqs.sort()
        targets.append((shard.fqn, shard.offset or (), found[0] * itemsize, hash(tuple(reqs))))
    if all(len(row) == 4 + 2 * width for row in rows):
        table = np.array(rows, dtype=np.int64).reshape(len(rows), 4 + 2 * width)
    else:
        table = np.zeros((len(rows), 4 + 2 * width), dtype=np.int64)
        table[:, 4 + width:] = 1
        for i, row in enumerate(rows):  # rows of fewer dimensions padded: offsets 0, lengths 1
            n = (len(row) - 4) // 2
            table[i, :4 + n] = row[:4 + n]
            table[i, 4 + width:4 + width + n] = row[4 + n:]
    return tuple(targets), SplitReads(table, tuple(dest_of))


def assign_reads(layouts: Sequence[TargetLayout], splits: Optional[Sequence[SplitReads]] = None) -> list[Reply]:
    """The coordinator's step: per rank, its :data:`Reply` to the ``layouts`` and ``splits`` of
    :func:`read_layout` (``splits`` ``None``: no chunk exchange).  Replica groups first: a reader
    per replicated shard, largest first, to the member with the fewest bytes so far (a shard
    only one rank reads counts at its place in that order), ties to the lowest rank.  Then the
    chunks two ranks or more need non-contiguous pieces of, outside each rank's own replica
    groups: a reader per chunk alike, by the bytes of its run (the pieces' first row to their
    last), counted apart from the replicas' bytes."""
    replies = _assign_replicas(layouts)
    if splits is None:
        return [(reply, None) for reply in replies]
    return list(zip(replies, _assign_exchanges(splits, replies)))


class _Group:
    __slots__ = ("classes", "key", "nbytes", "ranks", "source")

    def __init__(self, key: TargetEntry, first_class: int) -> None:
        self.key = key
        self.nbytes = key[2]
        self.classes = [first_class]
        self.ranks: RankTuple = ()
        self.source = -1


def _assign_replicas(layouts: Sequence[TargetLayout]) -> list[AssignmentReply]:
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


class _ChunksOf(dict):
    """Per tensor FQN (on first use): its chunks' sizes, its dtype and (with
    ``places``) the chunks' places in the global order of every stored chunk: FQNs in key
    order, each FQN's chunks by offsets (:func:`order_key`'s order, the same on every rank)."""

    def __init__(self, sd: dict[str, Any], places: bool) -> None:
        super().__init__()
        self.sd = sd
        self.first: Optional[dict[str, int]] = None if places else {}

    def __missing__(self, fqn: str) -> tuple[list[tuple[int, ...]], Any, list[int]]:
        md = self.sd[fqn]
        chunks = md.chunks
        table = isinstance(chunks, ChunkTable)
        sizes = chunks.size_tuples() if table else [tuple(c.sizes) for c in chunks]
        places: list[int] = []
        if self.first is None:
            self.first, n = {}, 0
            for name in sorted((f for f, m in self.sd.items() if isinstance(m, TensorStorageMetadata)),
                               key=lambda f: chunk_key(f, ())):
                self.first[name] = n
                n += len(self.sd[name].chunks)
        if self.first:
            first = self.first[fqn]
            places = list(range(first, first + len(sizes)))
            if not (table and chunks.ascending):
                offsets = [tuple(c.offsets) for c in chunks]
                for k, j in enumerate(sorted(range(len(offsets)), key=offsets.__getitem__), first):
                    places[j] = k
        found = self[fqn] = (sizes, md.properties.dtype, places)
        return found


def _assign_exchanges(splits: Sequence[SplitReads], replies: Sequence[AssignmentReply]) -> list[ExchangeReply]:
    """Per rank, its :data:`ExchangeReply` (see :func:`assign_reads`).  Vectorised: a load of
    2000 small tensors on 4 ranks has 32000 such reads."""
    width = max(((s.table.shape[1] - 4) // 2 for s in splits), default=0)
    grouped_of: dict[int, set[tuple[str, tuple[int, ...]]]] = {}  # a rank's own groups, shared per class
    parts = []
    for rank, s in enumerate(splits):
        table, kept = s.table, np.arange(len(s.table))
        reply = replies[rank]
        if reply is not None and id(reply[0]) not in grouped_of:
            grouped_of[id(reply[0])] = {(fqn, offsets) for fqn, offsets, _, _ in reply[0]}
        grouped = grouped_of[id(reply[0])] if reply is not None else None
        if grouped and len(table):
            kept = np.flatnonzero(np.array([d not in grouped for d in s.dests], dtype=bool)[table[:, _DEST]])
            table = table[kept]
        n = (table.shape[1] - 4) // 2
        part = np.zeros((len(table), 3 + 2 * width), dtype=np.int64)  # [chunk, rank, row, boxes]
        part[:, 0], part[:, 1], part[:, 2] = table[:, _CHUNK], rank, kept
        part[:, 3:3 + n] = table[:, 4:4 + n]
        part[:, 3 + width:] = 1
        part[:, 3 + width:3 + width + n] = table[:, 4 + n:]
        parts.append((part, table[:, _ROW_BYTES]))
    answers = [(np.full((len(s.table), 3), -1, dtype=np.int64), np.zeros((0, 2 + 2 * width), dtype=np.int64))
               for s in splits]
    if not parts or not sum(len(p) for p, _ in parts):
        return answers
    table = np.concatenate([p for p, _ in parts])
    row_bytes = np.concatenate([b for _, b in parts])
    # by chunk, rank, then the box: each chunk's pieces together, its members ascending
    order = np.lexsort(table[:, [*range(table.shape[1] - 1, 2, -1), 1, 0]].T)
    table, row_bytes = table[order], row_bytes[order]
    place, member = table[:, 0], table[:, 1]
    new_chunk = np.empty(len(table), dtype=bool)
    new_chunk[0], new_chunk[1:] = True, place[1:] != place[:-1]
    new_member = new_chunk.copy()
    new_member[1:] |= member[1:] != member[:-1]
    starts = np.flatnonzero(new_chunk)
    group = np.cumsum(new_chunk) - 1  # each row's chunk, in 0..len(starts)
    members = np.add.reduceat(new_member.astype(np.int64), starts)
    first = np.minimum.reduceat(table[:, 3], starts)
    count = np.maximum.reduceat(table[:, 3] + table[:, 3 + width], starts) - first
    nbytes = count * row_bytes[starts]
    shared = np.flatnonzero(members >= 2)
    # largest run first, then the global order; min keeps the first of equal loads and
    # members ascend: ties go to the lowest rank
    visit = shared[np.lexsort((place[starts[shared]], -nbytes[shared]))]
    member_ranks = member[new_member].tolist()
    member_start = (np.cumsum(new_member) - 1)[starts].tolist() + [len(member_ranks)]
    load = [0] * len(splits)
    reader_of = [-1] * len(starts)
    size = nbytes.tolist()
    for g in visit.tolist():
        reader = min(member_ranks[member_start[g]:member_start[g + 1]], key=load.__getitem__)
        load[reader] += size[g]
        reader_of[g] = reader
    row_reader = np.asarray(reader_of, dtype=np.int64)[group]
    per_row = np.stack([row_reader, first[group], count[group]], axis=1)
    by_rank = np.argsort(member, kind="stable")
    bounds = np.searchsorted(member[by_rank], np.arange(len(splits) + 1))
    for r in range(len(splits)):
        mine = by_rank[bounds[r]:bounds[r + 1]]
        answers[r][0][table[mine, 2]] = per_row[mine]
    # the pieces each reader sends: rows of exchanged chunks, duplicates (one box read for two
    # target shards of a rank) once, grouped by reader in the sorted order
    same = np.zeros(len(table), dtype=bool)
    same[1:] = (table[1:, [0, 1, *range(3, table.shape[1])]] == table[:-1, [0, 1, *range(3, table.shape[1])]]).all(1)
    sent = np.flatnonzero((row_reader >= 0) & ~same)
    sent = sent[np.argsort(row_reader[sent], kind="stable")]
    pieces = np.delete(table[sent], 2, axis=1)
    bounds = np.searchsorted(row_reader[sent], np.arange(len(splits) + 1))
    for r in range(len(splits)):
        answers[r] = (answers[r][0], pieces[bounds[r]:bounds[r + 1]])
    return answers


def apply_assignment(plan: LoadPlan, metadata: Metadata, splits: SplitReads, reply: Reply, rank: int) -> LoadPlan:
    """``plan`` (this rank's, whose :func:`read_layout` gave ``splits``) with its
    :class:`ReaderAssignment` from ``reply`` (its replica groups, every multi-member rank tuple
    of the load, the :class:`ChunkExchange` entries it takes part in, in the global order) and
    every item's reader as ``source``: a replicated shard's reads its group's reader, the reads a
    chunk exchange serves its chunk's reader, the others ``rank`` (left as planned where
    nothing is replicated)."""
    answers, exchanged = reply
    groups: list[ReplicaGroup] = []
    required: tuple[RankTuple, ...] = ()
    items = list(plan.items)
    if answers is not None:
        unpacked: dict[int, RankTuple] = {}

        def unpack(ranks: PackedRanks) -> RankTuple:
            out = unpacked.get(id(ranks))
            if out is None:
                out = unpacked[id(ranks)] = tuple(ranks)
            return out

        source_of: dict[tuple[str, tuple[int, ...]], int] = {}
        for fqn, offsets, ranks, source in answers[0]:
            source_of[(fqn, offsets)] = source
            groups.append(ReplicaGroup(MetadataIndex(fqn, offsets), unpack(ranks), source))
        required = tuple(unpack(r) for r in answers[1])
        items = [_sourced(it, source_of.get((it.dest_index.fqn, it.dest_index.offset or ()), rank))
                 if it.type is LoadItemType.TENSOR else _sourced(it, rank) for it in items]
    exchanges = _exchanges(items, metadata, splits, exchanged) if exchanged is not None and len(splits) else ()
    return replace(plan, items=tuple(items), planner_data=ReaderAssignment(tuple(groups), required, exchanges))


def _sourced(item: ReadItem, source: int) -> ReadItem:
    return ReadItem(item.type, item.dest_index, item.dest_offsets, item.storage_index, item.storage_offsets,
                    item.lengths, source)


def _exchanges(items: list[ReadItem], metadata: Metadata, splits: SplitReads,
               reply: ExchangeReply) -> tuple[ChunkExchange, ...]:
    """The :class:`ChunkExchange` entries ``reply`` names, in the global order; the reads they
    serve in ``items`` take their chunk's reader as ``source``."""
    per_row, pieces = reply
    exchanged = np.flatnonzero(per_row[:, 0] >= 0)
    if not len(exchanged):
        return ()
    places, at = np.unique(splits.table[exchanged, _CHUNK], return_index=True)  # a row per chunk, in order
    rows = exchanged[at]
    width = (pieces.shape[1] - 2) // 2
    starts = np.searchsorted(pieces[:, 0], places).tolist()
    ends = np.searchsorted(pieces[:, 0], places, side="right").tolist()
    chunks_of = _ChunksOf(metadata.state_dict_metadata, places=False)
    out = []
    for (reader, first, count), position, start, end in zip(per_row[rows].tolist(), splits.table[rows, _ITEM].tolist(),
                                                            starts, ends):
        index = items[position].storage_index
        assert index.index is not None
        sizes, dtype, _ = chunks_of[index.fqn]
        shape = sizes[index.index]
        mine = None
        if end > start:  # this rank reads it: its pieces, [rank, offsets, lengths] of the chunk's dims
            n = len(shape)
            mine = pieces[start:end, 1:] if n == width else \
                pieces[start:end][:, [1, *range(2, 2 + n), *range(2 + width, 2 + width + n)]]
        out.append(ChunkExchange(index, shape, dtype, (first, count), reader, mine))
    # the reads the coordinator gave a reader (what exchanged_reads finds again)
    for position, reader in zip(splits.table[exchanged, _ITEM].tolist(), per_row[exchanged, 0].tolist()):
        items[position] = _sourced(items[position], reader)
    return tuple(out)


def assign_readers(all_plans: Sequence[LoadPlan], metadata: Metadata, exchange: bool = False) -> list[LoadPlan]:
    """Every rank's final plan at once: the three steps of the load pipeline in one process
    (``exchange``: with chunk exchanges)."""
    layouts = [read_layout(p, metadata) for p in all_plans]
    replies = assign_reads([t for t, _ in layouts], [s for _, s in layouts] if exchange else None)
    return [apply_assignment(p, metadata, s, reply, r)
            for r, (p, (_, s), reply) in enumerate(zip(all_plans, layouts, replies))]


def assignment_of(plan: LoadPlan) -> ReaderAssignment:
    """The :class:`ReaderAssignment` of ``plan`` (an empty one when it has none)."""
    data = plan.planner_data
    return data if isinstance(data, ReaderAssignment) else ReaderAssignment()


def exchanged_reads(plan: LoadPlan) -> Iterator[tuple[ReadItem, Optional[ChunkExchange]]]:
    """Every item of ``plan`` with the :class:`ChunkExchange` that serves it (``None``: read as planned)."""
    data = assignment_of(plan)
    of_chunk = {(x.storage_index.fqn, x.storage_index.offset): x for x in data.exchanges}
    grouped = {group.dest_index for group in data.groups}
    contiguous = _contiguity()
    for item in plan.items:
        index = item.storage_index
        x = of_chunk.get((index.fqn, index.offset)) if of_chunk and item.type is LoadItemType.TENSOR else None
        served = x is not None and (not grouped or item.dest_index not in grouped) and \
            not contiguous(x.shape, item.storage_offsets, item.lengths)
        yield item, x if served else None


def _contiguity() -> Callable[[tuple[int, ...], tuple[int, ...], tuple[int, ...]], bool]:
    """Whether a slice ``(offsets, lengths)`` of a chunk of ``sizes`` is one run of it (memoised)."""
    return functools.cache(lambda sizes, offsets, lengths: slice_span(sizes, offsets, lengths)[2])
