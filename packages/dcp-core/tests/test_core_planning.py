"""Planning in one process: dedup, metadata, load plans, reader assignment, plan cache.

The property test simulates a whole save and load without any storage or process group:
random save layouts (boxes partitioning each tensor, some held by several ranks), dedup,
metadata, then random load layouts whose read items are executed against an in-memory
"storage" (stored chunk → tensor).  Every target element must be written exactly once and
end up equal to the original tensor.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from core_planning_strategies import partition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import ChunkBox, full_box
from hyper_parallel_dcp.core.errors import MismatchError, MissingKeyError, MissingRegionError, UnsupportedTensorError
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo, TensorStorageMetadata
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from hyper_parallel_dcp.core.save_planning import plan_global_save_deferred
from hyper_parallel_dcp.core.standard_planner import (
    StandardLoadPlanner,
    StandardSavePlanner,
    assign_readers,
    build_metadata,
    create_local_load_plan,
    create_local_save_plan,
    dedup_save_plans,
)
from hyper_parallel_dcp.core.storage import StorageReader, StorageWriter, WriteResult
from hyper_parallel_dcp.core.testing import run_distributed


def _slices(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


# ------------------------------------------------------------------ random layouts
@st.composite
def _placed(draw, shape, world):
    """Per rank, the boxes it holds: a partition, each part on a non-empty set of ranks."""
    parts = draw(partition(shape))
    per_rank: list[list[ChunkBox]] = [[] for _ in range(world)]
    for box in parts:
        holders = draw(st.sets(st.integers(0, world - 1), min_size=1))
        for r in holders:
            per_rank[r].append(box)
    return per_rank


@st.composite
def _scenario(draw):
    n_tensors = draw(st.integers(1, 3))
    shapes = [tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))) for _ in range(n_tensors)]
    save_world = draw(st.integers(1, 4))
    load_world = draw(st.integers(1, 4))
    save = [draw(_placed(s, save_world)) for s in shapes]
    load = [draw(_placed(s, load_world)) for s in shapes]
    return shapes, save_world, load_world, save, load


def _flat_for_rank(rank, tensors, layouts, *, fill=None) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for i, (full, per_rank) in enumerate(zip(tensors, layouts)):
        pieces = []
        for box in per_rank[rank]:
            data = full[_slices(box.offsets, box.sizes)].clone()
            if fill is not None:
                data.fill_(fill)
            pieces.append((box, data))
        flat[f"t{i}"] = TensorShards(tuple(full.shape), full.dtype, pieces)
    return flat


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenario())
def test_random_save_and_load_layouts_read_each_target_element_exactly_once(case):
    shapes, save_world, load_world, save_layouts, load_layouts = case
    tensors = [torch.arange(math.prod(s), dtype=torch.int64).view(s) * 7 + i for i, s in enumerate(shapes)]

    # save: local plans → dedup → metadata; the owner's data goes to "storage"
    local = [create_local_save_plan(_flat_for_rank(r, tensors, save_layouts)) for r in range(save_world)]
    final = dedup_save_plans([plan for plan, _, _ in local])
    metadata = build_metadata(final)
    storage: dict[MetadataIndex, torch.Tensor] = {}
    for rank, plan in enumerate(final):
        for item in plan.items:
            assert item.index not in storage, f"{item.index} written twice"
            storage[item.index] = local[rank][1][item.index]
    for i, full in enumerate(tensors):
        md = metadata.state_dict_metadata[f"t{i}"]
        assert isinstance(md, TensorStorageMetadata)
        assert tuple(md.size) == tuple(full.shape) and md.properties.dtype == torch.int64
        distinct = {b for per_rank in save_layouts[i] for b in per_rank}
        assert sorted((c.offsets, c.sizes) for c in md.chunks) == sorted((b.offsets, b.sizes) for b in distinct)
        for c in md.chunks:  # the stored bytes are the original values
            assert torch.equal(storage[MetadataIndex(f"t{i}", c.offsets)], full[_slices(c.offsets, c.sizes)])

    # load: every rank plans against the metadata and executes its reads from "storage"
    all_plans = []
    targets = []
    for rank in range(load_world):
        flat = _flat_for_rank(rank, tensors, load_layouts, fill=-1)
        plan, shards = create_local_load_plan(flat, metadata)
        all_plans.append(plan)
        targets.append(shards)
        pieces = {MetadataIndex(fqn, box.offsets): view for fqn, s in shards.items() for box, view in s.pieces}
        counts = {key: torch.zeros(view.shape, dtype=torch.int64) for key, view in pieces.items()}
        for item in plan.items:
            md = metadata.state_dict_metadata[item.storage_index.fqn]
            assert md.chunks[item.storage_index.index].offsets == item.storage_index.offset  # lookup hint is right
            src = storage[item.storage_index][_slices(item.storage_offsets, item.lengths)]
            dst = _slices(item.dest_offsets, item.lengths)
            pieces[item.dest_index][dst] = src
            counts[item.dest_index][dst] += 1
        for key, c in counts.items():
            assert bool((c == 1).all()), f"rank {rank}: {key} covered {c.tolist()}"
        for fqn, s in shards.items():
            full = tensors[int(fqn[1:])]
            for box, view in s.pieces:
                assert torch.equal(view, full[_slices(box.offsets, box.sizes)])

    # read-once assignment: one reader per group of identical requests, agreed by all members
    planned = assign_readers(all_plans, metadata)
    source_of: dict[tuple[int, MetadataIndex], set[int]] = {}
    for rank, plan in enumerate(planned):
        assert [(it.dest_index, it.storage_index, it.lengths) for it in plan.items] == \
               [(it.dest_index, it.storage_index, it.lengths) for it in all_plans[rank].items]
        for it in plan.items:
            source_of.setdefault((rank, it.dest_index), set()).add(it.source)
        for group in plan.planner_data.groups:
            dest, ranks, src = group.dest_index, group.ranks, group.source
            assert rank in ranks and src in ranks and len(ranks) > 1
            for member in ranks:
                assert source_of.get((member, dest), {src}) <= {src}
    assert all(len(s) == 1 for s in source_of.values())


# ------------------------------------------------------------------ dedup tables
def _shards(total: int, start: int, length: int) -> TensorShards:
    return TensorShards((total,), torch.float32, [(ChunkBox((start,), (length,)), torch.zeros(length))])


def _plans_of_t(*pieces: tuple[int, int, int]) -> list[SavePlan]:
    """One plan per rank holding the piece ``(total, start, length)`` of the tensor "t"."""
    return [create_local_save_plan({"t": _shards(*piece)})[0] for piece in pieces]


def _owners(final: list[SavePlan]) -> dict[str, int]:
    return {item.index.fqn: rank for rank, plan in enumerate(final) for item in plan.items
            if item.index.fqn != "u" or item.sizes == (250,)}


def _planned_bytes(final: list[SavePlan]) -> list[int]:
    return [sum(it.nbytes for it in plan.items) for plan in final]


def test_dedup_gives_replicated_chunks_to_the_rank_with_fewest_bytes():
    # rank 0 holds 1000 unique bytes, rank 1 only 40; A..D (400, 300, 200, 100 bytes) are on both
    replicated = {"A": torch.zeros(100), "B": torch.zeros(75), "C": torch.zeros(50), "D": torch.zeros(25)}
    r0 = {"u": _shards(260, 0, 250), **replicated}
    r1 = {"u": _shards(260, 250, 10), **replicated}
    plans = [create_local_save_plan(r0)[0], create_local_save_plan(r1)[0]]
    final = dedup_save_plans(plans)
    # largest first, each to the rank with fewer planned bytes: 40 → 440 → 740 → 940 → 1040
    assert {it.index.fqn for it in final[1].items} == {"u", "A", "B", "C", "D"}
    assert [it.index.fqn for it in final[0].items] == ["u"]
    assert _planned_bytes(final) == [1000, 1040]
    minimum = dedup_save_plans(plans, save_to_minimum_rank=True)
    assert {it.index.fqn for it in minimum[0].items} == {"u", "A", "B", "C", "D"}
    assert _planned_bytes(minimum) == [2000, 40]


def test_dedup_ties_go_to_the_lowest_rank_and_balance_three_ranks():
    x, y, z, w = torch.zeros(100), torch.zeros(100), torch.zeros(50), torch.zeros(25)
    plans = [create_local_save_plan(sd)[0] for sd in (
        {"x": x, "y": y, "z": z},
        {"x": x, "y": y, "z": z, "w": w},
        {"x": x, "y": y, "z": z, "w": w},
    )]
    final = dedup_save_plans(plans)
    # x (400 B, tie → rank 0), y (400 B → rank 1), z (200 B → rank 2), w (100 B: ranks 1/2 have 400/200 → 2)
    assert [[it.index.fqn for it in p.items] for p in final] == [["x"], ["y"], ["z", "w"]]
    assert dedup_save_plans(plans) == final  # deterministic


_STEPS = {
    "dedup": dedup_save_plans,
    "dedup, then metadata": lambda plans: build_metadata(dedup_save_plans(plans)),
    "metadata": build_metadata,
    "deferred global plan (before any metadata is asked for)": lambda plans: plan_global_save_deferred(plans),
}


@pytest.mark.parametrize("step, pieces, message", [
    ("dedup", ((8, 0, 4), (8, 0, 3)), r"'t': ranks 0 and 1 hold different pieces"),
    ("dedup, then metadata", ((8, 0, 5), (8, 4, 4)), r"'t': stored chunks overlap"),
    ("metadata", ((8, 0, 4), (9, 4, 4)), r"'t' has global shape \[8\].*\[9\] / float32 on rank 1"),
    ("deferred global plan (before any metadata is asked for)", ((8, 0, 5), (8, 4, 4)), r"'t': stored chunks overlap"),
])
def test_global_planning_refuses_conflicting_pieces_shapes_and_overlaps(step, pieces, message):
    with pytest.raises(ValueError, match=message):
        _STEPS[step](_plans_of_t(*pieces))


def test_the_deferred_global_plan_builds_the_metadata_later():
    plans = [create_local_save_plan({"t": _shards(8, 0, 4), "w": torch.zeros(3), "o": {"a": 1}})[0],
             create_local_save_plan({"t": _shards(8, 4, 4), "w": torch.zeros(3), "o": {"a": 1}})[0]]
    out, build = plan_global_save_deferred(plans)
    assert out == dedup_save_plans(plans)
    built = build()
    assert built.state_dict_metadata == build_metadata(out).state_dict_metadata
    assert list(built.state_dict_metadata) == ["t", "w", "o"]
    assert [c.offsets for c in built.state_dict_metadata["t"].chunks] == [(0,), (4,)]


def test_load_plan_errors_name_the_fqn():
    metadata = build_metadata([create_local_save_plan({"w": torch.zeros(4, 2), "obj": {"a": 1}, "half": _shards(8, 0, 4)})[0]])
    with pytest.raises(MissingKeyError, match=r"'nope' is not in the checkpoint"):
        create_local_load_plan({"nope": torch.zeros(1)}, metadata)
    with pytest.raises(MismatchError, match=r"'w': shape mismatch: checkpoint has \[4, 2\], target expects \[2, 4\]"):
        create_local_load_plan({"w": torch.zeros(2, 4)}, metadata)
    # another dtype is not an error: the read casts (as torch DCP does)
    assert len(create_local_load_plan({"w": torch.zeros(4, 2, dtype=torch.bfloat16)}, metadata)[0].items) == 1
    assert create_local_load_plan({"w": torch.zeros(4, 2), "nope": torch.zeros(1)}, metadata,
                                  allow_partial_load=True)[0].items[0].dest_index.fqn == "w"
    with pytest.raises(MismatchError, match=r"'obj' is stored as an object"):
        create_local_load_plan({"obj": torch.zeros(1)}, metadata)
    with pytest.raises(MismatchError, match=r"'w' is stored as a tensor"):
        create_local_load_plan({"w": "text"}, metadata)
    with pytest.raises(MissingRegionError, match=r"'half'.*offsets=\[0\] sizes=\[8\] \(4 of 8"):
        create_local_load_plan({"half": torch.zeros(8)}, metadata)


def test_missing_keys_are_all_counted_and_a_wrapper_prefix_is_pointed_out():
    """A model that grew a layer: every key it lacks is counted, the first few named."""
    metadata = build_metadata([create_local_save_plan({"w": torch.zeros(4, 2)})[0]])
    grown = {"w": torch.zeros(4, 2), **{f"extra.{i}": torch.zeros(1) for i in range(10)}}
    with pytest.raises(MissingKeyError) as info:
        create_local_load_plan(grown, metadata)
    text = str(info.value)
    assert text.startswith("10 keys are not in the checkpoint (1 key stored): 'extra.0', 'extra.1', ")
    assert "'extra.7' and 2 more; remove them from the state dict, or pass allow_partial_load=True" in text
    assert "'extra.8'" not in text and "wrapper" not in text
    # saved from a torch.compile'd (or DDP) model's own state_dict(), loaded into the bare model
    wrapped = build_metadata([create_local_save_plan({"model._orig_mod.0.weight": torch.zeros(2),
                                                      "model.module.1.bias": torch.zeros(2)})[0]])
    with pytest.raises(MissingKeyError) as info:
        create_local_load_plan({"model.0.weight": torch.zeros(2), "model.1.bias": torch.zeros(2)}, wrapped)
    assert ("The checkpoint has 'model._orig_mod.0.weight' for 'model.0.weight': the two differ by a wrapper's "
            "module name") in str(info.value)
    # and the other way round: saved bare, loaded into a wrapped model's state_dict()
    with pytest.raises(MissingKeyError, match=r"has 'w' for 'module\.w'"):
        create_local_load_plan({"module.w": torch.zeros(4, 2)}, metadata)
    # a Hugging Face import stores the model at the top level; loaded under {"model": ...}
    hf = build_metadata([create_local_save_plan({"model.layers.0.weight": torch.zeros(2),
                                                 "lm_head.weight": torch.zeros(2)})[0]])
    with pytest.raises(MissingKeyError) as info:
        create_local_load_plan({"model.model.layers.0.weight": torch.zeros(2), "model.lm_head.weight": torch.zeros(2)},
                               hf)
    assert ("The checkpoint has 'model.layers.0.weight' for 'model.model.layers.0.weight': its keys lack the "
            "prefix 'model.'") in str(info.value)
    # saved under {"model": ...}, loaded at the top level
    with pytest.raises(MissingKeyError, match=r"has 'model\.layers\.0\.weight' for 'layers\.0\.weight': its keys carry "
                                              r"the prefix 'model\.'; nest the state dict under it \(\{'model': \.\.\.\}\)"):
        create_local_load_plan({"layers.0.weight": torch.zeros(2)}, hf)
    # a prefix that explains one key of several is a coincidence, not a hint
    grown = build_metadata([create_local_save_plan({"model.0.weight": torch.zeros(2), "weight": torch.zeros(2)})[0]])
    with pytest.raises(MissingKeyError) as info:
        create_local_load_plan({"model.3.weight": torch.zeros(2), "model.3.bias": torch.zeros(2),
                                "model.4.bias": torch.zeros(2)}, grown)
    assert "The checkpoint has" not in str(info.value)


_UNSUPPORTED = {
    "meta": (lambda: torch.empty(3, device="meta"), "is on the meta device and holds no data"),
    "sparse": (lambda: torch.eye(3).to_sparse(), "is a sparse_coo tensor: only dense \\(strided\\)"),
    "csr": (lambda: torch.eye(3).to_sparse_csr(), "is a sparse_csr tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "is a nested tensor"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
                  "has the quantized dtype torch.qint8"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # prototype / beta / deprecated tensor kinds
@pytest.mark.parametrize("kind", list(_UNSUPPORTED))
def test_a_tensor_without_storable_data_is_named_on_save_and_load(kind):
    """torch's own errors name no key ("Cannot copy out of meta tensor; no data!")."""
    make, why = _UNSUPPORTED[kind]
    if kind == "meta":
        # a save is planned from shapes alone (the Hugging Face importer's planner supplies
        # the data); the writer refuses a meta tensor's data (tests/test_errors_bad_input.py)
        assert len(create_local_save_plan({"ok": torch.zeros(2), "model.w": make()})[0].items) == 2
    else:
        with pytest.raises(UnsupportedTensorError, match=rf"^'model\.w' {why}") as info:
            create_local_save_plan({"ok": torch.zeros(2), "model.w": make()})
        assert isinstance(info.value, TypeError)
    metadata = build_metadata([create_local_save_plan({"model.w": torch.zeros(3)})[0]])
    with pytest.raises(UnsupportedTensorError, match=rf"^'model\.w' {why}"):
        create_local_load_plan({"model.w": make()}, metadata)

def test_assign_readers_spreads_equal_shards_over_the_group():
    metadata = build_metadata([create_local_save_plan({f"p{i}": torch.zeros(10) for i in range(6)})[0]])
    flat = {f"p{i}": torch.zeros(10) for i in range(6)}
    plans = [create_local_load_plan(flat, metadata)[0] for _ in range(3)]
    planned = assign_readers(plans, metadata)
    readers = {it.dest_index.fqn: it.source for it in planned[0].items}
    assert sorted(readers.values()) == [0, 0, 1, 1, 2, 2]  # 6 equal shards over 3 ranks: 2 each
    for plan in planned[1:]:
        assert {it.dest_index.fqn: it.source for it in plan.items} == readers


# ------------------------------------------------------------------ orchestration, no process group
class MemoryWriter(StorageWriter):
    """A custom backend: overriding the abstract methods is enough (SPEC §3)."""

    def __init__(self, store: dict[str, Any]):
        self.store = store
        self.writes = 0

    def reset(self, checkpoint_id=None) -> None:
        self.checkpoint_id = checkpoint_id

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        results = []
        for pos, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            self.store[("data", item.index)] = data.clone() if isinstance(data, torch.Tensor) else data
            results.append(WriteResult(item.index, StorageInfo("memory", pos, 0), 0))
            self.writes += 1
        return results

    def finalize_checkpoint(self, metadata: Metadata, results) -> None:
        self.store["metadata"] = metadata


class MemoryReader(StorageReader):
    def __init__(self, store: dict[str, Any]):
        self.store = store

    def reset(self, checkpoint_id=None) -> None:
        pass

    def load_metadata(self) -> Metadata:
        return self.store["metadata"]

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        for item in plan.items:
            stored = self.store[("data", MetadataIndex(item.storage_index.fqn, item.storage_index.offset))]
            if item.type is LoadItemType.BYTE_IO:
                planner.load_bytes(item, stored)
                continue
            target = planner.resolve_tensor(item)
            target.copy_(stored[_slices(item.storage_offsets, item.lengths)])
            planner.commit_tensor(item, target)


class CountingSavePlanner(StandardSavePlanner):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.global_plans = 0

    def create_global_plan(self, all_plans):
        self.global_plans += 1
        return super().create_global_plan(all_plans)


def _model(scale: float) -> dict[str, Any]:
    return {"w": torch.arange(12.0).view(3, 4) * scale, "opt": {"step": 3, "m": [torch.ones(2) * scale]}}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_plan_cache_hit_skips_global_planning_and_writes_current_values():
    StandardSavePlanner.clear_cache()
    store: dict[str, Any] = {}
    first = CountingSavePlanner()
    md1 = save_state_dict(_model(1.0), MemoryWriter(store), first)
    assert first.global_plans == 1 and not first.cache_hit

    timing_logger = logging.getLogger("hyper_parallel_dcp.timing")
    collect = _Collect()
    old_level = timing_logger.level
    timing_logger.setLevel(logging.INFO)
    timing_logger.addHandler(collect)
    try:
        second = CountingSavePlanner()
        md2 = save_state_dict(_model(2.0), MemoryWriter(store), second)
    finally:
        timing_logger.removeHandler(collect)
        timing_logger.setLevel(old_level)
    assert second.cache_hit and second.global_plans == 0
    assert "[rank=0] Hit final plan and metadata cache." in collect.lines
    assert md2.state_dict_metadata == md1.state_dict_metadata
    # the cached plan still writes the *current* tensors, not the first save's
    assert torch.equal(store[("data", MetadataIndex("w", (0, 0)))], torch.arange(12.0).view(3, 4) * 2)

    target = {"w": torch.zeros(3, 4), "opt": {"step": None, "m": [torch.zeros(2)]}}
    load_state_dict(target, MemoryReader(store))
    assert torch.equal(target["w"], _model(2.0)["w"]) and torch.equal(target["opt"]["m"][0], torch.full((2,), 2.0))
    assert target["opt"]["step"] == 3

    other_keys = CountingSavePlanner()
    save_state_dict({"w": torch.zeros(3, 4)}, MemoryWriter(store), other_keys)
    assert not other_keys.cache_hit and other_keys.global_plans == 1

    no_cache = CountingSavePlanner(enable_plan_caching=False)
    save_state_dict(_model(3.0), MemoryWriter(store), no_cache)
    assert not no_cache.cache_hit and no_cache.global_plans == 1

    without_collectives = CountingSavePlanner()
    save_state_dict(_model(3.0), MemoryWriter(store), without_collectives, use_collectives=False)
    assert not without_collectives.cache_hit


def test_a_failed_save_leaves_no_plan_in_the_cache():
    class BrokenWriter(MemoryWriter):
        def execute_write(self, plan, planner):
            raise OSError("disk full")

    StandardSavePlanner.clear_cache()
    store: dict[str, Any] = {}
    with pytest.raises(OSError, match="disk full"):
        save_state_dict(_model(1.0), BrokenWriter(store), CountingSavePlanner())
    retry = CountingSavePlanner()
    save_state_dict(_model(1.0), MemoryWriter(store), retry)
    assert not retry.cache_hit and retry.global_plans == 1
    again = CountingSavePlanner()
    save_state_dict(_model(2.0), MemoryWriter(store), again)
    assert again.cache_hit and again.global_plans == 0
    StandardSavePlanner.clear_cache()


def test_plan_cache_misses_when_the_layout_changes_under_the_same_keys():
    """Same keys, another shape: plan again (and cache the new plan), never reuse a stale plan."""
    StandardSavePlanner.clear_cache()
    store: dict[str, Any] = {}
    save_state_dict({"w": torch.zeros(3, 4)}, MemoryWriter(store), CountingSavePlanner())
    changed = CountingSavePlanner()
    save_state_dict({"w": torch.ones(4, 4)}, MemoryWriter(store), changed)
    assert not changed.cache_hit and changed.global_plans == 1
    assert tuple(store["metadata"].state_dict_metadata["w"].size) == (4, 4)
    again = CountingSavePlanner()
    save_state_dict({"w": torch.full((4, 4), 2.0)}, MemoryWriter(store), again)
    assert again.cache_hit and again.global_plans == 0
    assert torch.equal(store[("data", MetadataIndex("w", (0, 0)))], torch.full((4, 4), 2.0))
    StandardSavePlanner.clear_cache()


def test_single_process_pipeline_reshards_into_other_boxes():
    """Save two row blocks, load into column blocks and a ragged-looking 3-piece layout."""
    StandardSavePlanner.clear_cache()
    full = torch.arange(30.0).view(5, 6)
    saved = {"w": TensorShards((5, 6), torch.float32, [
        (ChunkBox((0, 0), (2, 6)), full[0:2].clone()), (ChunkBox((2, 0), (3, 6)), full[2:5].clone())])}
    store: dict[str, Any] = {}
    save_state_dict(saved, MemoryWriter(store), StandardSavePlanner(enable_plan_caching=False))
    md = store["metadata"].state_dict_metadata["w"]
    assert [(c.offsets, c.sizes) for c in md.chunks] == [((0, 0), (2, 6)), ((2, 0), (3, 6))]
    left, right, corner = torch.zeros(5, 4), torch.zeros(4, 2), torch.zeros(1, 2)
    target = {"w": TensorShards((5, 6), torch.float32, [
        (ChunkBox((0, 0), (5, 4)), left), (ChunkBox((0, 4), (4, 2)), right), (ChunkBox((4, 4), (1, 2)), corner)])}
    load_state_dict(target, MemoryReader(store))
    assert torch.equal(left, full[:, :4]) and torch.equal(right, full[:4, 4:]) and torch.equal(corner, full[4:, 4:])


@pytest.mark.parametrize("dtype,make_view", [
    pytest.param(torch.float32, lambda: (lambda root: root.view_as(root))(torch.zeros(8, 6)), id="view-of-a-tensor"),
    pytest.param(torch.float32, lambda: torch.zeros(10, 6)[1:9], id="view-at-a-storage-offset"),
    pytest.param(torch.float32, lambda: torch.zeros(8, 6, dtype=torch.int32).view(torch.float32)[:], id="view-of-a-dtype-view"),
    pytest.param(torch.complex64, lambda: torch.zeros(8, 6, dtype=torch.complex64).conj(), id="conjugate-view"),
])
def test_partial_reads_into_a_view_land_in_its_memory(dtype, make_view):
    """A destination piece that is a view (a DTensor's local tensor made by ``from_local``
    is one) filled by two reads, each a part of it: the values land in the view, whichever
    tensor the partial destinations are made from (the view's root where that is the same
    memory and type, the view itself for a conjugate view or another dtype)."""
    StandardSavePlanner.clear_cache()
    full = (torch.arange(48.0).view(8, 6) * (1 + 2j if dtype.is_complex else 1)).to(dtype)
    saved = {"w": TensorShards((8, 6), dtype, [
        (ChunkBox((0, 0), (4, 6)), full[:4].clone()), (ChunkBox((4, 0), (4, 6)), full[4:].clone())])}
    store: dict[str, Any] = {}
    save_state_dict(saved, MemoryWriter(store), StandardSavePlanner(enable_plan_caching=False))
    view = make_view()
    load_state_dict({"w": TensorShards((8, 6), dtype, [(full_box((8, 6)), view)])}, MemoryReader(store))
    assert torch.equal(view, full)
    if view._base is not None and view._base.dtype == dtype:
        assert torch.equal(view._base[1:9] if view._base.shape[0] == 10 else view._base,
                           full.conj() if view.is_conj() else full)


class _CommittingPlanner(StandardLoadPlanner):
    """Sees every tensor read (a planner that post-processes what it receives)."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[Any] = []

    def commit_tensor(self, read_item, tensor) -> None:
        self.committed.append(read_item)


class _BufferingPlanner(StandardLoadPlanner):
    """Reads into buffers of its own (a planner that converts what it receives)."""

    def resolve_tensor(self, read_item):
        self.last = torch.empty(read_item.lengths)
        return self.last


@pytest.mark.parametrize("planner_cls", [StandardLoadPlanner, _CommittingPlanner, _BufferingPlanner])
def test_a_region_is_the_memory_of_the_view_resolve_tensor_makes(planner_cls):
    """``resolve_region``: a read that fills a whole piece gets the piece's view; a read
    that fills part of a plain strided piece gets (tensor, offset, strides) whose
    ``as_strided`` is exactly the view ``resolve_tensor`` makes, unless the planner
    changes ``commit_tensor`` (it must see the read: it gets the view) or
    ``resolve_tensor`` (every read gets what that returns)."""
    StandardSavePlanner.clear_cache()
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    saved = {"w": TensorShards((8, 6), torch.float32, [
        (ChunkBox((0, 0), (4, 6)), full[:4].clone()), (ChunkBox((4, 0), (4, 6)), full[4:].clone())]),
        "same": TensorShards((8, 6), torch.float32, [(ChunkBox((0, 0), (4, 6)), full[:4].clone())])}
    store: dict[str, Any] = {}
    save_state_dict(saved, MemoryWriter(store), StandardSavePlanner(enable_plan_caching=False))
    metadata = MemoryReader(store).read_metadata()
    columns = torch.zeros(10, 3)[1:9]  # a view at a storage offset: regions are of its root
    target = {"w": TensorShards((8, 6), torch.float32, [(ChunkBox((0, 3), (8, 3)), columns)]),
              "same": TensorShards((8, 6), torch.float32, [(ChunkBox((0, 0), (4, 6)), torch.zeros(4, 6))])}
    planner = planner_cls()
    planner.set_up_planner(target, metadata, is_coordinator=True)
    plan = planner.create_local_plan()
    partial = [it for it in plan.items if it.dest_index.fqn == "w"]
    assert len(partial) == 2 and len(plan.items) == 3
    for item in plan.items:
        tensor, offset, strides = planner.resolve_region(item)
        if planner_cls is _BufferingPlanner:
            assert tensor is planner.last and offset is None
            continue
        view = planner.resolve_tensor(item)
        if item.dest_index.fqn == "same" or planner_cls is _CommittingPlanner:
            assert tensor is view or (tensor.data_ptr() == view.data_ptr() and tensor.stride() == view.stride())
            assert offset is None and strides == ()
            continue
        assert tensor is columns._base
        region = tensor.as_strided(item.lengths, strides, offset)
        assert (region.data_ptr(), region.shape, region.stride()) == (view.data_ptr(), view.shape, view.stride())
        region.copy_(full[item.dest_offsets[0]:item.dest_offsets[0] + item.lengths[0], 3:6])
    if planner_cls is StandardLoadPlanner:
        assert torch.equal(columns, full[:, 3:])


def _per_rank_objects_worker(rank: int, world_size: int) -> list:
    StandardSavePlanner.clear_cache()
    store: dict[str, Any] = {}
    seen = []
    for position in (lambda r: 7, lambda r: 100 + r, lambda r: 100 + r, lambda r: 8, lambda r: 9):
        planner = CountingSavePlanner()
        md = save_state_dict({"w": torch.ones(4), "position": position(rank)}, MemoryWriter(store), planner)
        seen.append((planner.cache_hit, sorted(md.rank_objects.get("position", {})),
                     store.get(("data", MetadataIndex("position")))))
    return seen


@pytest.mark.distributed
def test_a_cached_plan_that_stored_one_copy_does_not_serve_copies_that_now_differ():
    first, second = run_distributed(_per_rank_objects_worker, 2)
    # equal copies: one rank stores the one copy (rank 1: rank 0 holds "w"); differing copies
    # do not take that cached plan: planned anew (each rank stores its own) and not cached;
    # equal copies take the first save's plan again
    assert first == [(False, [], None), (False, [0, 1], 100), (False, [0, 1], 100), (True, [], 100), (True, [], 100)]
    assert second == [(False, [], 7), (False, [0, 1], 101), (False, [0, 1], 101), (True, [], 8), (True, [], 9)]
