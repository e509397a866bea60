"""The columnar global save plan equals the item-by-item reference on random plans.

``dedup_save_plans`` and ``build_metadata`` work on whole columns (:mod:`.global_save`);
:mod:`.save_reference` defines the result one item at a time.  On random plans — grids,
ragged and overlapping boxes, pieces held by several ranks, objects, scalars, empty
boxes, conflicting sizes, shapes, dtypes and kinds, as item tuples, as columns and mixed —
both give the same plans, the same metadata (same key order, same chunk order,
byte-identical JSON) or the same error message.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core import global_save
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.metadata import ChunkStorageMetadata, ChunkTable, MetadataIndex, metadata_to_json
from hyper_parallel_dcp.core.plan_columns import WriteColumns
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.save_planning import (
    StandardSavePlanner,
    build_metadata,
    dedup_save_plans,
    plan_global_save,
)
from hyper_parallel_dcp.core.save_reference import build_metadata_items, dedup_items


# ------------------------------------------------------------------ random plans
@st.composite
def _plans(draw):
    world = draw(st.integers(1, 5))
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(draw(st.integers(1, 4))):
        fqn = draw(st.sampled_from(["a", "b.c", f"t{t}", "layers.1 x"]))
        if draw(st.integers(0, 5)) == 0:  # an object, on some ranks
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1)):
                digest = draw(st.sampled_from([None, "aa" * 8, "bb" * 8]))  # copies that may differ
                per_rank[r].append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, digest=digest))
            continue
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        grid = draw(st.booleans())
        for _ in range(draw(st.integers(1, 6))):
            if grid:  # cells of a fixed grid: DTensor-like, usually disjoint
                offsets = tuple(draw(st.integers(0, max(0, d - 1))) // 2 * 2 for d in shape)
                sizes = tuple(min(2, d - o) for o, d in zip(offsets, shape))
            else:  # any box, possibly ragged, overlapping or empty
                offsets = tuple(draw(st.integers(0, d)) for d in shape)
                sizes = tuple(draw(st.integers(0, d - o)) for o, d in zip(offsets, shape))
            item_shape, item_dtype = shape, dtype
            if draw(st.integers(0, 15)) == 0:  # a rank that disagrees on the shape or dtype
                item_shape, item_dtype = (shape + (1,), dtype) if draw(st.booleans()) else (shape, "int8")
            nbytes = draw(st.sampled_from([0, 4, 8, 8, 16])) * max(1, len(sizes))
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1)):
                item = WriteItem(MetadataIndex(fqn, offsets), WriteItemType.TENSOR, sizes, item_shape, item_dtype,
                                 nbytes)
                if draw(st.integers(0, 20)) == 0:  # a rank that disagrees on the piece's size
                    item = replace(item, sizes=tuple(s + 1 for s in sizes))
                if all(it.index != item.index for it in per_rank[r]):
                    per_rank[r].append(item)
    return [SavePlan(tuple(draw(st.permutations(items)))) for items in per_rank]


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except (ValueError, TypeError) as exc:  # TypeError: an object and a scalar under one FQN
        return "error", f"{type(exc).__name__}: {exc}"


def _as_columns(plans, which):
    """``plans`` with the ranks flagged in ``which`` as unpickled columns (a gather's
    view of a standard planner's plan), the others as item tuples (a custom planner's)."""
    return [SavePlan(pickle.loads(pickle.dumps(WriteColumns.from_items(p.items)))) if flag else p
            for p, flag in zip(plans, which)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), to_minimum=st.booleans())
def test_columns_equal_the_per_item_reference(data, to_minimum):
    plans = data.draw(_plans())
    which = data.draw(st.lists(st.booleans(), min_size=len(plans), max_size=len(plans)))
    mixed = _as_columns(plans, which)
    fast = _outcome(dedup_save_plans, mixed, to_minimum)
    ref = _outcome(dedup_items, plans, to_minimum)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "error":
        assert fast[1] == ref[1]
        return
    assert fast[1] == ref[1]
    for out, plan, ref_out, ref_plan in zip(fast[1], mixed, ref[1], plans):
        # a rank that drops nothing keeps its plan object
        assert (out is plan) == (ref_out is ref_plan) == (tuple(out.items) == tuple(plan.items))
        assert pickle.loads(pickle.dumps(out)) == out
    for source, ref_source in ((mixed, plans), (fast[1], ref[1])):  # also without dedup (use_collectives=False)
        fast_md = _outcome(build_metadata, source)
        ref_md = _outcome(build_metadata_items, ref_source)
        assert fast_md[0] == ref_md[0], (fast_md, ref_md)
        if fast_md[0] == "error":
            assert fast_md[1] == ref_md[1]
            continue
        assert list(fast_md[1].state_dict_metadata) == list(ref_md[1].state_dict_metadata)
        assert fast_md[1].state_dict_metadata == ref_md[1].state_dict_metadata
        assert fast_md[1].rank_objects == ref_md[1].rank_objects
        # (a chunk with fewer offsets than its tensor has dims is refused here, by both)
        assert _outcome(metadata_to_json, fast_md[1]) == _outcome(metadata_to_json, ref_md[1])
    # the planner's one call equals the two steps
    both = _outcome(lambda: plan_global_save(mixed, dedup=True, save_to_minimum_rank=to_minimum))
    if both[0] == "ok":
        again = _outcome(build_metadata, fast[1])
        assert both[1][0] == fast[1]
        assert _outcome(metadata_to_json, both[1][1]) == _outcome(metadata_to_json, again[1])


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

    plans = _grid_plans(8, 2)
    expected = dedup_items(plans)
    monkeypatch.setattr(global_save, "dedup_items", refuse)
    monkeypatch.setattr(global_save, "build_metadata_items", refuse)
    final, metadata = StandardSavePlanner().create_global_plan(plans)
    assert final == expected
    assert metadata_to_json(metadata) == metadata_to_json(build_metadata_items(final))
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


def test_metadata_chunks_are_built_only_when_read():
    plans = [SavePlan((WriteItem(MetadataIndex("w", (2 * r, 0)), WriteItemType.TENSOR, (2, 3), (8, 3), "float32",
                                 24),)) for r in (3, 1, 0, 2)]
    md = build_metadata(plans).state_dict_metadata["w"]
    assert isinstance(md.chunks, ChunkTable)  # two integer columns, no object per chunk
    assert md.chunks == [ChunkStorageMetadata((2 * r, 0), (2, 3)) for r in range(4)]
    assert md.chunks[-1] == ChunkStorageMetadata((6, 0), (2, 3))  # a chunk object is built when read


@st.composite
def _tensors_of_boxes(draw):
    """Several tensors' chunks as rows (each tensor's rows together, sorted by offsets):
    grids, repeated offsets, ragged and empty boxes, 1 to 3 dims."""
    ndim = draw(st.integers(1, 3))
    kinds, offsets, sizes = [], [], []
    for kind in draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True)):
        boxes = draw(st.lists(st.tuples(st.tuples(*[st.integers(0, 6)] * ndim), st.tuples(*[st.integers(0, 4)] * ndim)),
                              min_size=1, max_size=6))
        for o, z in sorted(boxes, key=lambda box: box[0]):
            kinds.append(kind)
            offsets.append(o)
            sizes.append(z)
    return np.array(kinds), np.array(offsets), np.array(sizes)


@settings(max_examples=300, deadline=None)
@given(rows=_tensors_of_boxes())
def test_grid_suspects_are_each_tensors_own_and_clear_only_disjoint_chunks(rows):
    # all tensors at once, as each tensor's rows alone answer; a tensor not suspect has
    # pairwise disjoint chunks
    kinds, offsets, sizes = rows
    suspects = global_save._grid_suspects(kinds, offsets, sizes)
    for kind in set(kinds.tolist()):
        mine = kinds == kind
        assert (kind in suspects) == bool(global_save._grid_suspects(kinds[mine], offsets[mine], sizes[mine]))
        boxes = [ChunkBox(tuple(o), tuple(z)) for o, z in zip(offsets[mine].tolist(), sizes[mine].tolist())]
        if kind not in suspects:
            assert all(a.intersect(b) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _object_plans(digests: list[str]) -> list[SavePlan]:
    """One rank per digest, each holding a tensor row, ``loader.position`` (its digest) and
    ``shared`` (one digest on every rank)."""
    return [SavePlan(WriteColumns.from_items([
        WriteItem(MetadataIndex("w", (rank, 0)), WriteItemType.TENSOR, (1, 4), (len(digests), 4), "float32", 16),
        WriteItem(MetadataIndex("loader.position"), WriteItemType.BYTE_IO, digest=digest),
        WriteItem(MetadataIndex("shared"), WriteItemType.BYTE_IO, digest="00" * 8),
    ])) for rank, digest in enumerate(digests)]


def test_objects_that_differ_under_one_key_are_kept_on_every_rank_equal_ones_once(monkeypatch):
    plans = _object_plans(["aa" * 8, "bb" * 8, "aa" * 8])
    reference, ref_md = dedup_items(plans), build_metadata_items(dedup_items(plans))
    for name in ("dedup_items", "build_metadata_items"):
        monkeypatch.setattr(global_save, name, lambda *_: pytest.fail("the item path ran"))
    final, md = StandardSavePlanner().create_global_plan(plans)
    assert final == reference
    kept = [[(it.index.fqn, it.digest) for it in plan.items if it.type is WriteItemType.BYTE_IO] for plan in final]
    assert kept == [[("loader.position", "aa" * 8), ("shared", "00" * 8)], [("loader.position", "bb" * 8)],
                    [("loader.position", "aa" * 8)]]
    assert md.rank_objects == ref_md.rank_objects == {"loader.position": {}}  # filled as the ranks write
    assert list(md.state_dict_metadata) == list(ref_md.state_dict_metadata) == ["w", "loader.position", "shared"]
    assert metadata_to_json(md) == metadata_to_json(ref_md)
    same = _object_plans(["aa" * 8] * 3)
    final, md = StandardSavePlanner().create_global_plan(same)
    assert [sum(it.type is WriteItemType.BYTE_IO for it in plan.items) for plan in final] == [2, 0, 0]
    assert md.rank_objects == {}
