"""Reader assignment on the coordinator against the all-gather design it replaced.

The reference below is the all-gather implementation as it was (every rank grouped every
rank's plans itself); the coordinator's version must give every rank exactly the same
final plan: the same items with the same readers, the same replica groups, so the same
byte balance.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from typing import Sequence

import pytest
import torch
from core_planning_strategies import partition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import Metadata, TensorStorageMetadata
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, order_key
from hyper_parallel_dcp.core.reader_assignment import (
    ReaderAssignment,
    _pack,
    apply_assignment,
    assign_readers,
    assign_reads,
    read_layout,
)
from hyper_parallel_dcp.core.save_planning import build_metadata, create_local_save_plan


# ------------------------------------------------------------------ the all-gather reference
def _reference_replica_groups(all_plans: Sequence[LoadPlan]) -> dict:
    per_rank_shards = []
    for plan in all_plans:
        shards: dict = {}
        for item in plan.items:
            if item.type is LoadItemType.TENSOR:
                shards.setdefault(item.dest_index, []).append(
                    (item.storage_index.offset, item.storage_offsets, item.dest_offsets, item.lengths))
        per_rank_shards.append(shards)
    groups: dict = {}
    for rank, shards in enumerate(per_rank_shards):
        for dest, reqs in shards.items():
            groups.setdefault((dest, tuple(sorted(reqs))), []).append(rank)
    return groups


def _reference_assign_readers(all_plans: Sequence[LoadPlan], metadata: Metadata):
    """The all-gather design: (final plans, replica groups per rank as (dest, ranks, source))."""
    groups = _reference_replica_groups(all_plans)
    if all(len(ranks) == 1 for ranks in groups.values()):
        return list(all_plans), [() for _ in all_plans]
    assigned = [0] * len(all_plans)
    sizes = []
    for dest, sig in groups:
        md = metadata.state_dict_metadata[dest.fqn]
        itemsize = md.properties.dtype.itemsize if isinstance(md, TensorStorageMetadata) else 1
        nbytes = sum(math.prod(req[3]) for req in sig) * itemsize
        sizes.append((-nbytes, order_key(dest), sig, dest))
    sizes.sort(key=lambda t: (t[0], t[1], tuple(groups[(t[3], t[2])])))
    source_of: dict = {}
    membership: list[list] = [[] for _ in all_plans]
    for neg_bytes, key, sig, dest in sizes:
        ranks = groups[(dest, sig)]
        reader = min(ranks, key=lambda r: (assigned[r], r))
        assigned[reader] -= neg_bytes
        members = tuple(ranks)
        for r in ranks:
            source_of[(r, dest)] = reader
            if len(members) > 1:
                membership[r].append((key, dest, members, reader))
    out, group_lists = [], []
    for rank, plan in enumerate(all_plans):
        items = tuple(
            replace(it, source=source_of.get((rank, it.dest_index), rank)) if it.type is LoadItemType.TENSOR
            else replace(it, source=rank)
            for it in plan.items
        )
        out.append(replace(plan, items=items))
        group_lists.append(tuple((dest, ranks, src) for _, dest, ranks, src in sorted(membership[rank],
                                                                                    key=lambda m: m[0])))
    return out, group_lists


def _assigned_bytes(plans: Sequence[LoadPlan], metadata: Metadata) -> list[int]:
    """Bytes each rank reads from storage for the group (itself included) under ``plans``."""
    out = [0] * len(plans)
    for rank, plan in enumerate(plans):
        for it in plan.items:
            if it.type is LoadItemType.TENSOR:
                itemsize = metadata.state_dict_metadata[it.dest_index.fqn].properties.dtype.itemsize
                reader = rank if it.source is None else it.source
                if reader == rank:
                    out[rank] += math.prod(it.lengths) * itemsize
    return out


# ------------------------------------------------------------------ random layouts
@st.composite
def _case(draw):
    """A stored checkpoint and per load rank a target: a few target partitions per tensor
    (so ranks share some shards exactly and differ on others, also at equal offsets)."""
    world = draw(st.integers(1, 9))
    n = draw(st.integers(1, 4))
    dtypes = [draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8])) for _ in range(n)]
    shapes = [tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))) for _ in range(n)]
    stored = [draw(partition(s, max_parts=5)) for s in shapes]
    targets = []
    for s in shapes:
        variants = [draw(partition(s, max_parts=5)) for _ in range(draw(st.integers(1, 3)))]
        per_rank = []
        for _ in range(world):
            parts = draw(st.sampled_from(variants))
            per_rank.append([b for b in parts if draw(st.booleans()) or len(parts) == 1])
        targets.append(per_rank)
    with_object = draw(st.booleans())
    return world, dtypes, shapes, stored, targets, with_object


def _plans(case):
    world, dtypes, shapes, stored, targets, with_object = case
    save_flat = {f"t{i}": TensorShards(shape, dtype, [(b, torch.zeros(b.sizes, dtype=dtype)) for b in boxes])
                 for i, (dtype, shape, boxes) in enumerate(zip(dtypes, shapes, stored))}
    if with_object:
        save_flat["step"] = 3
    metadata = build_metadata([create_local_save_plan(save_flat)[0]])
    plans = []
    for rank in range(world):
        flat: dict = {f"t{i}": TensorShards(shape, dtype, [(b, torch.zeros(b.sizes, dtype=dtype))
                                                         for b in per_rank[rank]])
                      for i, (dtype, shape, per_rank) in enumerate(zip(dtypes, shapes, targets))}
        if with_object:
            flat["step"] = 0
        plans.append(create_local_load_plan(flat, metadata)[0])
    return plans, metadata


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_coordinator_assignment_equals_the_all_gather_design(case):
    plans, metadata = _plans(case)
    expected, expected_groups = _reference_assign_readers(plans, metadata)
    got = assign_readers(plans, metadata)
    assert [p.items for p in got] == [p.items for p in expected]  # same reads, same readers
    for rank, plan in enumerate(got):
        assert isinstance(plan.planner_data, ReaderAssignment)
        assert tuple((g.dest_index, g.ranks, g.source) for g in plan.planner_data.groups) == expected_groups[rank]
    required = sorted({ranks for groups in expected_groups for _, ranks, _ in groups})
    assert all(list(plan.planner_data.required) == required for plan in got)
    # one reader per replicated shard, a member of its group, the same for every member
    readers: dict = {}
    for rank, plan in enumerate(got):
        for g in plan.planner_data.groups:
            assert rank in g.ranks and g.source in g.ranks
            assert readers.setdefault((g.dest_index, g.ranks), g.source) == g.source
    assert _assigned_bytes(got, metadata) == _assigned_bytes(expected, metadata)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_a_rank_receives_only_its_own_groups(case):
    plans, metadata = _plans(case)
    layouts = [read_layout(p, metadata) for p in plans]
    replies = assign_reads([targets for targets, _ in layouts])
    for rank, (plan, (_, splits), (reply, _)) in enumerate(zip(plans, layouts, replies)):
        final = apply_assignment(plan, metadata, splits, (reply, None), rank)
        dests = {it.dest_index for it in plan.items}
        assert {g.dest_index for g in final.planner_data.groups} <= dests
        if reply is not None:
            assert len(reply[0]) == len(final.planner_data.groups)


def test_replicas_share_one_reader_per_shard_balanced_by_bytes():
    """4 tensors in 2 row halves, each half replicated on 4 ranks: 8 equal shards, 1 per rank."""
    save_flat = {f"w{i}": torch.zeros(8, 4) for i in range(4)}
    metadata = build_metadata([create_local_save_plan(save_flat)[0]])
    plans = []
    for rank in range(8):
        row = rank % 2
        flat = {f"w{i}": TensorShards((8, 4), torch.float32, [(ChunkBox((4 * row, 0), (4, 4)),
                                                                torch.zeros(4, 4))]) for i in range(4)}
        plans.append(create_local_load_plan(flat, metadata)[0])
    got = assign_readers(plans, metadata)
    assert _assigned_bytes(got, metadata) == [64] * 8
    assert list(got[0].planner_data.required) == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_rank_tuples_travel_as_ranges_when_they_step_evenly():
    assert _pack(tuple(range(3, 8192, 4))) == range(3, 8192, 4)
    assert len(pickle.dumps(_pack(tuple(range(3, 8192, 4))))) < 100
    assert _pack((0, 1, 6, 7)) == (0, 1, 6, 7)
    assert _pack((2, 5)) == (2, 5)
    for ranks in [(0, 2, 4, 6), (1, 3, 9), (0, 1), (5,)]:
        assert tuple(_pack(ranks)) == ranks


def test_nothing_replicated_leaves_the_items_alone():
    metadata = build_metadata([create_local_save_plan({"w": torch.zeros(4)})[0]])
    plans = [create_local_load_plan({"w": TensorShards((4,), torch.float32, [(ChunkBox((2 * r,), (2,)),
                                                                              torch.zeros(2))])}, metadata)[0]
             for r in range(2)]
    got = assign_readers(plans, metadata)
    assert [p.items for p in got] == [p.items for p in plans]
    assert all(p.planner_data == ReaderAssignment() for p in got)


@pytest.mark.parametrize("world", [4, 16])
def test_equal_sized_unreplicated_shards_count_at_their_place_in_the_order(world):
    """Shards only one rank reads, of the same size as replicated ones, interleave by key."""
    save_flat = {name: torch.zeros(4) for name in ("a", "b", "c", "d")}
    metadata = build_metadata([create_local_save_plan(save_flat)[0]])
    plans = []
    for rank in range(world):
        flat = {"b": torch.zeros(4), "d": torch.zeros(4)}  # replicated on all
        flat["a" if rank % 2 else "c"] = torch.zeros(4)     # replicated on half
        plans.append(create_local_load_plan(flat, metadata)[0])
    plans[1] = create_local_load_plan({"a": torch.zeros(4), "b": torch.zeros(4), "d": torch.zeros(4),
                                       "c": torch.zeros(4)}, metadata)[0]
    expected, _ = _reference_assign_readers(plans, metadata)
    assert [p.items for p in assign_readers(plans, metadata)] == [p.items for p in expected]
