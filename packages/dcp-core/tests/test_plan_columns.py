"""Save plans as columns: WriteColumns round trips, and the coordinator's planning over
columns equals the per-item reference, for column plans, item plans and a mix of both."""

from __future__ import annotations

import importlib.util
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core import save_planning
from hyper_parallel_dcp.core.metadata import MetadataIndex, metadata_to_json
from hyper_parallel_dcp.core.plan_columns import WriteColumns
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.save_planning import (
    StandardSavePlanner,
    build_metadata,
    create_local_save_plan,
    dedup_save_plans,
    plan_global_save,
)

_REFERENCE = Path(__file__).with_name("test_save_planning_columns.py")


def _reference():
    spec = importlib.util.spec_from_file_location("save_planning_reference_for_columns", _REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference()

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


def _as_columns(plans, which):
    """``plans`` with the ranks flagged in ``which`` as unpickled columns (a gather's
    view of a standard planner's plan), the others as item tuples (a custom planner's)."""
    return [SavePlan(pickle.loads(pickle.dumps(WriteColumns.from_items(p.items)))) if flag else p
            for p, flag in zip(plans, which)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), to_minimum=st.booleans())
def test_column_and_mixed_plans_equal_the_per_item_reference(data, to_minimum):
    plans = data.draw(REF._plans())
    which = data.draw(st.lists(st.booleans(), min_size=len(plans), max_size=len(plans)))
    mixed = _as_columns(plans, which)
    fast = REF._outcome(dedup_save_plans, mixed, to_minimum)
    ref = REF._outcome(REF._ref_dedup, plans, to_minimum)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "error":
        assert fast[1] == ref[1]
        return
    assert fast[1] == ref[1]
    for out, plan in zip(fast[1], mixed):  # a rank that drops nothing keeps its plan object
        assert (out is plan) == (tuple(out.items) == tuple(plan.items))
        assert pickle.loads(pickle.dumps(out)) == out
    fast_md = REF._outcome(build_metadata, mixed)
    ref_md = REF._outcome(REF._ref_build_metadata, plans)
    assert fast_md[0] == ref_md[0]
    if fast_md[0] == "ok":
        assert list(fast_md[1].state_dict_metadata) == list(ref_md[1].state_dict_metadata)
        assert REF._outcome(metadata_to_json, fast_md[1]) == REF._outcome(metadata_to_json, ref_md[1])
    else:
        assert fast_md[1] == ref_md[1]
    # the planner's one call equals the two steps
    both = REF._outcome(lambda: plan_global_save(mixed, dedup=True, save_to_minimum_rank=to_minimum))
    if both[0] == "ok":
        again = REF._outcome(build_metadata, fast[1])
        assert both[1][0] == fast[1]
        assert REF._outcome(metadata_to_json, both[1][1]) == REF._outcome(metadata_to_json, again[1])


def _grid_plans(world: int, replicas: int) -> list[SavePlan]:
    """``world`` ranks, ``replicas`` of them holding each row block of three tensors."""
    plans = []
    for rank in range(world):
        block = rank // replicas
        items = [WriteItem(MetadataIndex(f"layer{t}.w", (2 * block, 0)), WriteItemType.TENSOR, (2, 5),
                           (2 * world // replicas, 5), "float32", 40) for t in range(3)]
        items.append(WriteItem(MetadataIndex("step"), WriteItemType.BYTE_IO))
        plans.append(SavePlan(WriteColumns.from_items(items)))
    return plans


def test_well_formed_plans_never_take_the_item_path(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the item path ran")

    monkeypatch.setattr(save_planning, "_dedup_items", refuse)
    monkeypatch.setattr(save_planning, "_build_metadata_items", refuse)
    plans = _grid_plans(8, 2)
    final, metadata = StandardSavePlanner().create_global_plan(plans)
    assert final == REF._ref_dedup(plans)
    assert metadata_to_json(metadata) == metadata_to_json(REF._ref_build_metadata(final))
    # each of 4 row blocks of 3 tensors once, and the object once
    assert sum(len(p.items) for p in final) == 4 * 3 + 1


def test_a_rank_that_drops_items_gets_columns_of_its_own_table():
    plans = _grid_plans(4, 4)  # every rank holds the same chunks
    final = dedup_save_plans(plans)
    kept = [it for p in final for it in p.items]
    assert sorted(it.index.fqn for it in kept) == ["layer0.w", "layer1.w", "layer2.w", "step"]
    for out, plan in zip(final, plans):
        assert isinstance(out.items, WriteColumns)
        if out is not plan:
            assert out.items.kinds_text == plan.items.kinds_text


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
