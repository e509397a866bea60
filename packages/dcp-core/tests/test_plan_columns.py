"""Save plans as columns: WriteColumns round trips, and a rank's final plan reuses its own
item objects (the coordinator's planning over columns: test_save_planning_columns.py)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.plan_columns import WriteColumns
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.save_planning import StandardSavePlanner, create_local_save_plan

_ITEMS = (
    WriteItem(MetadataIndex("w", (0, 4)), WriteItemType.TENSOR, (2, 4), (4, 8), "bfloat16", 16),
    WriteItem(MetadataIndex("step"), WriteItemType.BYTE_IO),
    WriteItem(MetadataIndex("w", (2, 0)), WriteItemType.TENSOR, (2, 4), (4, 8), "bfloat16", 16),
    WriteItem(MetadataIndex("scalar", ()), WriteItemType.TENSOR, (), (), "float32", 4),
    WriteItem(MetadataIndex("ragged", (3,)), WriteItemType.TENSOR, (0,), (3,), "int64", 0),
    # not what the standard planner makes, but a custom planner may: kept exactly
    WriteItem(MetadataIndex("odd", (1, 2, 3)), WriteItemType.TENSOR, (1,), None, None, 7),
    WriteItem(MetadataIndex("obj", (5,)), WriteItemType.BYTE_IO, None, None, None, 3),
)


def test_columns_round_trip_to_the_same_items():
    columns = WriteColumns.from_items(_ITEMS)
    assert len(columns) == len(_ITEMS)
    assert columns == _ITEMS and _ITEMS == columns
    assert columns.kinds[0] == ("w", "tensor", (4, 8), "bfloat16")
    # what a gather delivers: only columns, the items rebuilt when read
    back = pickle.loads(pickle.dumps(columns))
    assert back._items is None
    assert tuple(back) == _ITEMS
    assert [back[i] for i in range(len(_ITEMS))] == list(_ITEMS)
    assert back[1:3] == _ITEMS[1:3]
    assert back == columns and hash(back) == hash(_ITEMS)
    assert back != _ITEMS[:-1]
    plan = SavePlan(WriteColumns.from_items(_ITEMS), save_id="x")
    assert pickle.loads(pickle.dumps(plan)) == SavePlan(_ITEMS, save_id="x")
    # no item object travels
    assert b"WriteItem" not in pickle.dumps(plan)


def test_columns_refuse_a_ragged_row_table():
    with pytest.raises(ValueError, match="multiple of 4"):
        WriteColumns((), [0, 1, 2], [], [])


def test_the_standard_local_plan_is_columns_with_the_item_objects_kept():
    flat = {"a": torch.zeros(3, 2), "b": 7, "c": torch.zeros(0)}
    plan, data, ragged = create_local_save_plan(flat)
    assert isinstance(plan.items, WriteColumns) and plan.items._items is not None
    assert [it.index.fqn for it in plan.items] == ["a", "b", "c"]
    assert all(it.index in data for it in plan.items)
    assert not ragged


def test_a_rank_that_keeps_its_plan_reuses_its_own_items():
    planners = [StandardSavePlanner(enable_plan_caching=False) for _ in range(2)]
    for rank, planner in enumerate(planners):
        planner.set_up_planner({f"r{rank}.w": torch.zeros(2, 2), "shared": torch.ones(3)}, is_coordinator=rank == 0,
                               rank=rank, world_size=2)
    sent = [pickle.dumps(p.create_local_plan()) for p in planners]
    final, _ = planners[0].create_global_plan([pickle.loads(b) for b in sent])
    received = [planner.finish_plan(pickle.loads(pickle.dumps(plan))) for planner, plan in zip(planners, final)]
    local = [p.create_local_plan().items for p in planners]
    kept = [tuple(it.index.fqn for it in plan.items) for plan in received]
    assert sorted(kept) == sorted([("r0.w", "shared"), ("r1.w",)])  # "shared" written once
    for plan, own, names in zip(received, local, kept):
        # the rank's own item objects, whether it dropped items or not
        assert all(a is b for a, b in zip(plan.items, (it for it in own if it.index.fqn in names)))
        assert tuple(plan.items) == tuple(it for it in own if it.index.fqn in names)


def test_a_cut_is_refused_when_the_plan_it_names_differs():
    own = WriteColumns.from_items(_ITEMS)
    # items 0 and 2 as the coordinator cuts them: the rank's kind table, rows, offsets, sizes
    cut = WriteColumns(own.kinds_text, own.rows[0:4] + own.rows[8:12], [0, 4, 2, 0], [2, 4, 2, 4], picked=[0, 2])
    other = WriteColumns.from_items([_ITEMS[0], _ITEMS[1], replace(_ITEMS[2], index=MetadataIndex("w", (2, 4)))]
                                    + list(_ITEMS[3:]))
    assert other.kinds_text == own.kinds_text
    assert cut.reuse_items_of(other) is False  # same kinds, another piece at position 2
    wrong_place = WriteColumns(own.kinds_text, cut.rows, cut.offsets, cut.sizes, picked=[0, 1])
    assert wrong_place.reuse_items_of(own) is False
    assert cut.reuse_items_of(own) is True
    assert all(a is b for a, b in zip(cut, (_ITEMS[0], _ITEMS[2])))
    back = pickle.loads(pickle.dumps(cut))
    assert back.picked == cut.picked and back == cut
