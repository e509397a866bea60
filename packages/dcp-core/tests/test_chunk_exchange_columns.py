"""Chunk exchanges planned as columns against the per-piece design they replaced.

The reference below plans the exchanges as the per-piece version did (a set of ``(rank,
storage_offsets, lengths)`` per chunk, sorted tuples, readers largest first); the columns
version (:func:`read_layout` → :func:`assign_reads` → :func:`apply_assignment`)
must give every rank the same exchanges (chunk, shape, rows, reader, pieces) and the same
final items, replica groups left out as before.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter

import torch
from core_planning_strategies import partition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import ChunkBox, slice_span
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import MetadataIndex, TensorStorageMetadata
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem, order_key
from hyper_parallel_dcp.core.reader_assignment import (
    ReaderAssignment,
    apply_assignment,
    assign_reads,
    read_layout,
)
from hyper_parallel_dcp.core.save_planning import build_metadata, create_local_save_plan


def _reference(plans, metadata, replies):
    """Per rank: its exchanges as ``(index, shape, rows, reader, pieces or ())``, in the global order."""
    sd = metadata.state_dict_metadata
    # a rank's reads of its own replica groups' shards stay out (another rank's group at the same
    # offsets does not: its shard there may be of another size)
    grouped = [{(fqn, offsets) for fqn, offsets, _, _ in reply[0]} if reply is not None else set()
               for reply in replies]
    by_chunk: dict = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            index = item.storage_index
            if item.type is not LoadItemType.TENSOR or len(item.lengths) < 2 or index.index is None:
                continue
            md = sd[index.fqn]
            sizes = tuple(md.chunks[index.index].sizes)
            if slice_span(sizes, item.storage_offsets, item.lengths)[2]:
                continue
            if (item.dest_index.fqn, item.dest_index.offset or ()) in grouped[rank]:
                continue
            entry = by_chunk.setdefault((index.fqn, index.offset), [index.index, sizes, md.properties.dtype, set()])
            entry[3].add((rank, item.storage_offsets, item.lengths))
    chosen = []
    for (fqn, chunk), (pos, sizes, dtype, pieces) in by_chunk.items():
        ranks = sorted({p[0] for p in pieces})
        if len(ranks) < 2:
            continue
        first = min(p[1][0] for p in pieces)
        rows = (first, max(p[1][0] + p[2][0] for p in pieces) - first)
        nbytes = rows[1] * math.prod(sizes[1:]) * dtype.itemsize
        chosen.append((-nbytes, order_key(MetadataIndex(fqn, chunk)), MetadataIndex(fqn, chunk, pos), sizes, rows,
                       ranks, tuple(sorted(pieces))))
    chosen.sort(key=lambda c: c[:2])
    assigned: Counter = Counter()
    out: list[list] = [[] for _ in plans]
    for neg_bytes, key, index, sizes, rows, ranks, pieces in chosen:
        reader = min(ranks, key=assigned.__getitem__)
        assigned[reader] -= neg_bytes
        for rank in ranks:
            out[rank].append((key, (index, sizes, rows, reader, pieces if rank == reader else ())))
    return [[x for _, x in sorted(entries, key=lambda e: e[0])] for entries in out]


@st.composite
def _case(draw):
    """Stored row blocks (or any partition) of 2-3 dimensional tensors; per load rank a target
    drawn from a few partitions, so ranks share some shards exactly (replica groups) and
    need slices of the same chunks on others."""
    world = draw(st.integers(1, 6))
    n = draw(st.integers(1, 4))
    dtypes = [draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8])) for _ in range(n)]
    shapes = [tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=3))) for _ in range(n)]
    stored = [draw(partition(s, max_parts=4)) for s in shapes]
    targets = []
    for s in shapes:
        variants = [draw(partition(s, max_parts=4)) for _ in range(draw(st.integers(1, 3)))]
        per_rank = []
        for _ in range(world):
            parts = draw(st.sampled_from(variants))
            per_rank.append([b for b in parts if draw(st.booleans()) or len(parts) == 1])
        targets.append(per_rank)
    return world, dtypes, shapes, stored, targets, draw(st.booleans())


def _plans(case):
    world, dtypes, shapes, stored, targets, _ = case
    save_flat = {f"t{i}": TensorShards(shape, dtype, [(b, torch.zeros(b.sizes, dtype=dtype)) for b in boxes])
                 for i, (dtype, shape, boxes) in enumerate(zip(dtypes, shapes, stored))}
    metadata = build_metadata([create_local_save_plan(save_flat)[0]])
    plans = []
    for rank in range(world):
        flat = {f"t{i}": TensorShards(shape, dtype, [(b, torch.zeros(b.sizes, dtype=dtype)) for b in per_rank[rank]])
                for i, (dtype, shape, per_rank) in enumerate(zip(dtypes, shapes, targets))}
        plans.append(create_local_load_plan(flat, metadata)[0])
    return plans, metadata


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_columns_plan_the_exchanges_of_the_per_piece_design(case):
    _check(case)


def test_a_shard_outside_the_groups_at_a_grouped_shards_offsets_is_exchanged():
    """Ranks 0 and 1 share a row of ``t0`` at (0, 0) (a replica group); rank 3's own shard at
    (0, 0) is a column piece in no group: it comes from the exchange's reader like its other
    piece (the coordinator once left it out, while the rank's own plan expected it from the exchange)."""
    one = [ChunkBox((0, 0), (1, 1))]
    t0 = [[ChunkBox((0, 0), (1, 2))], [ChunkBox((0, 0), (1, 2))], [ChunkBox((0, 1), (4, 1))],
          [ChunkBox((0, 0), (2, 1)), ChunkBox((2, 0), (2, 1))], []]
    _check((5, [torch.float32] * 4, [(4, 2), (1, 1), (1, 1), (1, 1)], [[ChunkBox((0, 0), (4, 2))], one, one, one],
            [t0, [one] * 5, [one] * 5, [one] * 5], True))


def _check(case):
    plans, metadata = _plans(case)
    with_groups = case[-1]
    layouts = [read_layout(p, metadata) for p in plans]
    # what travels: the columns, pickled (no object per read or per piece)
    sent = [pickle.loads(pickle.dumps(layout)) for layout in layouts]
    if not with_groups:  # no replica entries: every shard read alone
        sent = [((), splits) for _, splits in sent]
    answers = [pickle.loads(pickle.dumps(a)) for a in assign_reads([t for t, _ in sent], [s for _, s in sent])]
    replies = [groups for groups, _ in answers]
    finals = [apply_assignment(p, metadata, s, a, r) for r, (p, (_, s), a) in enumerate(zip(plans, layouts, answers))]
    # the reference sees the plans as the replica step left them
    grouped = [apply_assignment(p, metadata, s, (g, None), r)
               for r, (p, (_, s), g) in enumerate(zip(plans, layouts, replies))]
    expected = _reference(grouped, metadata, replies)
    plans = grouped
    for rank, final in enumerate(finals):
        data = final.planner_data if isinstance(final.planner_data, ReaderAssignment) else ReaderAssignment()
        got = [(x.storage_index, x.shape, x.rows, x.reader, tuple(x.sent())) for x in data.exchanges]
        assert got == [(i, s, r, reader, pieces) for i, s, r, reader, pieces in expected[rank]]
        assert all((x.pieces is not None) == (x.reader == rank) for x in data.exchanges)
        assert all(x.dtype == metadata.state_dict_metadata[x.storage_index.fqn].properties.dtype
                   for x in data.exchanges)
        # every read of an exchanged chunk outside the replica groups, not contiguous in it, comes
        # from its reader; every other read is as planned
        reader_of = {(x.storage_index.fqn, x.storage_index.offset): x.reader for x in data.exchanges}
        grouped = {g.dest_index for g in data.groups}
        for before, after in zip(plans[rank].items, final.items):
            index = before.storage_index
            md = metadata.state_dict_metadata.get(index.fqn)
            served = (index.fqn, index.offset) in reader_of and before.dest_index not in grouped and \
                isinstance(md, TensorStorageMetadata) and index.index is not None and \
                not slice_span(tuple(md.chunks[index.index].sizes), before.storage_offsets, before.lengths)[2]
            want = ReadItem(before.type, before.dest_index, before.dest_offsets, index, before.storage_offsets,
                            before.lengths, reader_of[(index.fqn, index.offset)]) if served else before
            assert after == want
