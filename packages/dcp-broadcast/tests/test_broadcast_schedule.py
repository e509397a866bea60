"""Single-process tests of the broadcast schedule (pure) and the read-ahead thread."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.broadcast.prefetch import ReadAhead
from hyper_parallel_dcp.broadcast.schedule import (
    BroadcastOp,
    LaunchStep,
    ShardInfo,
    ShardStep,
    plan_broadcasts,
    rank_schedule,
    replica_groups_of,
    required_groups,
)
from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, ReadItem, order_key
from hyper_parallel_dcp.core.ragged import RaggedShard
from hyper_parallel_dcp.core.reader_assignment import ReaderAssignment
from hyper_parallel_dcp.core.standard_planner import (
    assign_readers,
    build_metadata,
    create_local_load_plan,
    create_local_save_plan,
)


# ------------------------------------------------------------------ plan_broadcasts
def _info(nbytes, ranks=(0, 1), source=0, dtype=torch.float32):
    return ShardInfo(ranks, source, dtype, nbytes)


def _ops(steps):
    return [s.op for s in steps if isinstance(s, LaunchStep)]


def test_unbatched_broadcasts_each_shard_right_after_reading_it():
    shards = [_info(4), _info(8), _info(100)]
    steps = plan_broadcasts(shards, batch_bytes=0)
    assert steps == [
        ShardStep(0), LaunchStep(BroadcastOp((0, 1), 0, (0,), False)),
        ShardStep(1), LaunchStep(BroadcastOp((0, 1), 0, (1,), False)),
        ShardStep(2), LaunchStep(BroadcastOp((0, 1), 0, (2,), False)),
    ]


def test_small_shards_batch_per_group_source_dtype_and_flush_before_overflow():
    shards = [
        _info(40),                          # 0: batch A
        _info(40, source=1),                # 1: batch B (other source)
        _info(40, dtype=torch.int64),       # 2: batch C (other dtype)
        _info(500),                         # 3: large, alone
        _info(50),                          # 4: batch A reaches 90
        _info(20),                          # 5: 110 > 100 -> A flushed before 5 is read
        _info(80),                          # 6: A' = 20 + 80 = 100 -> flushed at once
        _info(30, ranks=(0, 2)),            # 7: other group
    ]
    steps = plan_broadcasts(shards, batch_bytes=100)
    assert steps == [
        ShardStep(0), ShardStep(1), ShardStep(2),
        ShardStep(3), LaunchStep(BroadcastOp((0, 1), 0, (3,), False)),
        ShardStep(4),
        LaunchStep(BroadcastOp((0, 1), 0, (0, 4), True)),
        ShardStep(5), ShardStep(6),
        LaunchStep(BroadcastOp((0, 1), 0, (5, 6), True)),
        ShardStep(7),
        # leftovers in key order; a batch of one ships the shard itself
        LaunchStep(BroadcastOp((0, 1), 0, (2,), False)),
        LaunchStep(BroadcastOp((0, 1), 1, (1,), False)),
        LaunchStep(BroadcastOp((0, 2), 0, (7,), False)),
    ]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 2), st.integers(0, 1), st.booleans()),
                   min_size=0, max_size=40),
    batch_bytes=st.sampled_from([0, 1, 64, 100, 256, 10_000]),
)
def test_every_shard_is_read_once_and_broadcast_once_after_its_read(sizes, batch_bytes):
    groups = [(0, 1), (0, 2), (0, 1, 2, 3)]
    shards = [ShardInfo(groups[g], groups[g][s], torch.float16 if half else torch.float32, n)
              for n, g, s, half in sizes]
    steps = plan_broadcasts(shards, batch_bytes)
    read_at = {s.index: pos for pos, s in enumerate(steps) if isinstance(s, ShardStep)}
    assert sorted(read_at) == list(range(len(shards)))
    assert [s.index for s in steps if isinstance(s, ShardStep)] == list(range(len(shards)))  # global order kept
    shipped = []
    for pos, step in enumerate(steps):
        if not isinstance(step, LaunchStep):
            continue
        op = step.op
        shipped.extend(op.shards)
        assert all(read_at[i] < pos for i in op.shards)
        members = [shards[i] for i in op.shards]
        assert {(m.ranks, m.source, m.dtype) for m in members} == {(op.ranks, op.source, members[0].dtype)}
        assert op.batched == (len(op.shards) > 1)
        if op.batched:
            assert sum(m.nbytes for m in members) <= batch_bytes
            assert all(m.nbytes < batch_bytes for m in members)
        if batch_bytes == 0:
            assert len(op.shards) == 1
    assert sorted(shipped) == list(range(len(shards)))


# ------------------------------------------------------------------ global plans → schedules
_SHAPES = {"emb": (8, 4), "norm": (4,), "bias.0": (3,), "bias.1": (5,), "w": (6, 2), "tied": (2, 2)}


def _metadata():
    full = {k: torch.zeros(s) for k, s in _SHAPES.items()}
    full["step"] = 3
    plan, _, _ = create_local_save_plan(full)
    return build_metadata([plan])


def _rows(fqn, start, rows):
    shape = _SHAPES[fqn]
    return RaggedShard.from_rows(torch.zeros((rows, *shape[1:])), shape, start)


def _holdings(rank):
    """pp=2 x dp=2 x tp=2 style: stage 0 = ranks 0-3, stage 1 = ranks 4-7 (rank = pp*4 + dp*2 + tp)."""
    pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
    sd = {}
    if pp == 0:
        sd["emb"] = _rows("emb", 4 * tp, 4)                 # tp-sharded, dp-replicated
        sd["norm"] = torch.zeros(4)                         # replicated over the stage
        sd["bias.0"] = torch.zeros(3)
        sd["step"] = 0
    else:
        sd["w"] = _rows("w", dp * 2 + tp, 1)                # rows 0..3 of 6: fully sharded
        sd["bias.1"] = _rows("bias.1", dp * 2 + tp, 1)      # fully sharded
    if rank in (0, 1, 6, 7):
        sd["tied"] = torch.zeros(2, 2)
    return sd


def _global_plans(world=8):
    md = _metadata()
    plans = [create_local_load_plan(_holdings(r), md)[0] for r in range(world)]
    return assign_readers(plans, md)


def test_required_groups_are_the_same_sorted_list_for_every_rank():
    plans = _global_plans()
    groups = required_groups(plans[0])
    assert groups == [(0, 1, 2, 3), (0, 1, 6, 7), (0, 2), (1, 3)]
    # every rank's own plan carries the same list, also ranks in no group (4, 5)
    for plan in plans:
        assert required_groups(plan) == groups
    # The one list is the union of the per-rank views: each rank's own plan lists exactly
    # the groups of that list it belongs to (ranks 4 and 5 hold no replicated shard).
    for rank, plan in enumerate(plans):
        own = {g.ranks for g in replica_groups_of(plan)}
        assert own == {g for g in groups if rank in g}, rank
    assert not replica_groups_of(plans[4]) and not replica_groups_of(plans[5])


def test_rank_schedule_splits_replicated_shards_from_tail_reads():
    plans = _global_plans()
    sched = {r: rank_schedule(plans[r], r) for r in range(8)}
    assert [(t.dest_index.fqn, t.ranks) for t in sched[0].shards] == [
        ("bias.0", (0, 1, 2, 3)), ("emb", (0, 2)), ("norm", (0, 1, 2, 3)), ("tied", (0, 1, 6, 7))]
    # a rank of the stage without replicas: everything is its own, nothing broadcast
    assert sched[4].shards == ()
    assert {it.dest_index.fqn for it in sched[4].tail} == {"w", "bias.1"}
    # the non-tensor item is read by every holder itself, in the tail
    for r in range(4):
        assert [it.dest_index.fqn for it in sched[r].tail if it.type is LoadItemType.BYTE_IO] == ["step"]
    # every member agrees on the reader of each shard
    readers = {}
    for s in sched.values():
        for task in s.shards:
            assert readers.setdefault((task.dest_index, task.ranks), task.source) == task.source
            assert task.source in task.ranks
    # tail is in global read order
    for s in sched.values():
        keys = [order_key(it.dest_index) for it in s.tail]
        assert keys == sorted(keys)


def test_readers_are_chosen_largest_shard_first_to_the_least_loaded_member():
    plans = _global_plans()
    readers = {}
    for r in range(8):
        for task in rank_schedule(plans[r], r).shards:
            readers[(task.dest_index.fqn, task.dest_index.offset)] = task.source
    # By hand: emb halves (64 B) first -> ranks 0 and 1; norm (16 B) -> rank 2 (0 B so far);
    # tied (16 B, after norm in key order) -> rank 6; bias.0 (12 B) -> rank 3.
    assert readers == {("emb", (0, 0)): 0, ("emb", (4, 0)): 1, ("norm", (0,)): 2,
                       ("tied", (0, 0)): 6, ("bias.0", (0,)): 3}


@pytest.mark.parametrize("batch_bytes", [0, 16, 1 << 20])
def test_members_launch_a_groups_broadcasts_identically_and_in_one_global_order(batch_bytes):
    """The invariant behind 'no deadlock': per group, identical op sequences on every
    member; for any two ranks, the ops both launch come in the same relative order."""
    plans = _global_plans()
    launched = {}
    for r in range(8):
        sched = rank_schedule(plans[r], r)
        infos = [ShardInfo(t.ranks, t.source, torch.float32,
                           sum(torch.Size(it.lengths).numel() for it in t.items) * 4) for t in sched.shards]
        ops = _ops(plan_broadcasts(infos, batch_bytes))
        launched[r] = [(op.ranks, op.source, tuple(sched.shards[i].dest_index for i in op.shards)) for op in ops]
    for group in required_groups(plans[0]):
        seqs = {r: [op for op in launched[r] if op[0] == group] for r in group}
        assert len({tuple(s) for s in seqs.values()}) == 1, group
        assert seqs[group[0]]
    for a, b in itertools.combinations(range(8), 2):
        common = set(launched[a]) & set(launched[b])
        assert [op for op in launched[a] if op in common] == [op for op in launched[b] if op in common]


def test_a_plan_told_to_take_a_shard_outside_its_groups_is_refused():
    plans = _global_plans(4)
    # rank 2 loses its replica groups but keeps readers that are other ranks
    broken = LoadPlan(plans[2].items, planner_data=ReaderAssignment((), plans[2].planner_data.required))
    with pytest.raises(ValueError, match="share no replica group"):
        rank_schedule(broken, 2)


def test_plans_without_reader_assignment_read_everything_locally():
    md = _metadata()
    plans = [create_local_load_plan(_holdings(r), md)[0] for r in range(4)]
    assert all(required_groups(plan) == [] for plan in plans)
    sched = rank_schedule(plans[1], 1)
    assert sched.shards == ()
    assert len(sched.tail) == len(plans[1].items)


# ------------------------------------------------------------------ read-ahead
def _items(n):
    return [ReadItem(LoadItemType.TENSOR, MetadataIndex(f"t{i:03d}", (0,)), (0,), MetadataIndex(f"t{i:03d}", (0,)),
                     (0,), (1,)) for i in range(n)]


def test_read_ahead_yields_in_order_from_another_thread():
    threads = []

    def read_items(items):
        for it in items:
            threads.append(threading.get_ident())
            yield it, it.dest_index.fqn

    items = _items(25)
    with ReadAhead(read_items, items, depth=2) as ra:
        got = list(ra)
    assert [g[0] for g in got] == items
    assert [g[1] for g in got] == [f"t{i:03d}" for i in range(25)]
    assert set(threads) and threading.get_ident() not in threads


def test_read_ahead_stays_within_its_depth():
    produced = []
    grown = threading.Condition()

    def read_items(items):
        for it in items:
            with grown:
                produced.append(it)
                grown.notify_all()
            yield it, None

    ra = ReadAhead(read_items, _items(50), depth=2)
    next(ra)
    # The thread really reads ahead: one consumed + two queued + one blocked in put() ...
    with grown:
        assert grown.wait_for(lambda: len(produced) >= 4, timeout=60), produced
    # ... and no further while nobody consumes.
    with grown:
        assert not grown.wait_for(lambda: len(produced) > 4, timeout=0.3), len(produced)
    ra.close()
    assert not ra._thread.is_alive()


def test_read_ahead_raises_the_readers_error_where_it_happened():
    def read_items(items):
        for i, it in enumerate(items):
            if i == 3:
                raise OSError("disk gone at item 3")
            yield it, i

    ra = ReadAhead(read_items, _items(10))
    assert [next(ra)[1] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="item 3"):
        next(ra)
    with pytest.raises(StopIteration):
        next(ra)
    ra.close()
