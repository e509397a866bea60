"""The column-based dedup and metadata build equal the per-item reference on random plans.

``dedup_save_plans`` and ``build_metadata`` work on whole columns (one Python loop over the
items, then C and torch); the reference below is the per-item version they replaced, kept
here only as the oracle.  On random plans — grids, ragged and overlapping boxes, pieces
held by several ranks, objects, scalars, empty boxes, conflicting sizes, shapes, dtypes
and kinds — both give the same plans, the same metadata (same key order, same chunk
order, byte-identical JSON) or the same error message.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core import save_planning
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
    dtype_from_name,
    dtype_name,
    metadata_to_json,
)
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType, order_key
from hyper_parallel_dcp.core.save_planning import build_metadata, dedup_save_plans


# ------------------------------------------------------------------ the reference
def _ref_dedup(plans: Sequence[SavePlan], save_to_minimum_rank: bool = False) -> list[SavePlan]:
    holders: dict[tuple, list[Any]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            entry = holders.get(key)
            if entry is None:
                holders[key] = [item, rank]
                continue
            other = entry[0]
            if other.sizes != item.sizes or other.type != item.type:
                raise ValueError(
                    f"{item.index.fqn!r}: ranks {entry[1]} and {rank} hold different pieces at offsets "
                    f"{item.index.offset} (sizes {other.sizes} vs {item.sizes})"
                )
            entry.append(rank)
    planned = [0] * len(plans)
    replicated = []
    for key, entry in holders.items():
        if len(entry) == 2:
            planned[entry[1]] += entry[0].nbytes
        else:
            replicated.append((-entry[0].nbytes, order_key(entry[0].index), key))
    replicated.sort()
    dropped: dict[int, set[tuple]] = {}
    for neg_bytes, _, key in replicated:
        ranks = holders[key][1:]
        chosen = ranks[0] if save_to_minimum_rank else min(ranks, key=planned.__getitem__)
        planned[chosen] -= neg_bytes
        for r in ranks:
            if r != chosen:
                dropped.setdefault(r, set()).add(key)
    return [plan if not dropped.get(rank) else replace(plan, items=tuple(
        it for it in plan.items if (it.index.fqn, it.index.offset) not in dropped[rank]))
        for rank, plan in enumerate(plans)]


def _ref_sweep_overlap(order, dim):
    active: list[ChunkStorageMetadata] = []
    for chunk in order:
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > chunk.offsets[dim]]
        for other in active:
            if ChunkBox(chunk.offsets, chunk.sizes).intersect(ChunkBox(other.offsets, other.sizes)) is not None:
                return other, chunk
        active.append(chunk)
    return None


def _ref_find_overlap(chunks, dims):
    """The slab search over chunk objects (the overlapping pair it reports is part of the
    error message): equal intervals form slabs, partly overlapping ones a pairwise sweep."""
    if len(chunks) < 2:
        return None
    if not dims:
        return chunks[0], chunks[1]
    dim = dims[0]
    order = sorted(chunks, key=lambda c: (c.offsets[dim], c.sizes[dim]))
    slabs: list[list[ChunkStorageMetadata]] = []
    reach = None
    for chunk in order:
        start, size = chunk.offsets[dim], chunk.sizes[dim]
        if slabs and slabs[-1][0].offsets[dim] == start and slabs[-1][0].sizes[dim] == size:
            slabs[-1].append(chunk)
            continue
        if reach is not None and start < reach:
            return _ref_sweep_overlap(order, dim)
        slabs.append([chunk])
        reach = start + size
    for members in slabs:
        hit = _ref_find_overlap(members, dims[1:])
        if hit is not None:
            return hit
    return None


def _ref_build_metadata(plans: Sequence[SavePlan]) -> Metadata:
    sd: dict[str, Any] = {}
    first: dict[str, tuple] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            existing = sd.get(fqn)
            if item.type is not WriteItemType.TENSOR:
                if existing is not None and not isinstance(existing, BytesStorageMetadata):
                    raise ValueError(f"{fqn!r} is a tensor on some ranks and an object on rank {rank}")
                sd[fqn] = BytesStorageMetadata()
                continue
            if existing is None:
                existing = sd[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype_from_name(item.dtype)), torch.Size(item.global_shape), [])
                first[fqn] = (item.global_shape, item.dtype)
            elif isinstance(existing, BytesStorageMetadata):
                raise ValueError(f"{fqn!r} is an object on some ranks and a tensor on rank {rank}")
            elif first[fqn] != (item.global_shape, item.dtype):
                raise ValueError(
                    f"{fqn!r} has global shape {list(existing.size)} / {dtype_name(existing.properties.dtype)} "
                    f"on one rank but {list(item.global_shape)} / {item.dtype} on rank {rank}"
                )
            existing.chunks.append(ChunkStorageMetadata(item.index.offset, item.sizes))
    # Chunks of one tensor with different numbers of offsets are refused before any overlap
    # check (the per-item planner of old had no such check and fell into the scalar or the
    # overlap error by chance of the sort), naming the first chunk in plan order.
    for fqn, md in sd.items():
        if isinstance(md, TensorStorageMetadata):
            ndim = len(md.chunks[0].offsets)
            if any(len(c.offsets) != ndim for c in md.chunks):
                raise ValueError(f"{fqn!r}: chunks with {ndim} and with other numbers of offsets (the first at "
                                 f"{list(md.chunks[0].offsets)})")
    for fqn, md in sd.items():
        if isinstance(md, TensorStorageMetadata):
            md.chunks.sort(key=lambda c: c.offsets)
            if len(md.chunks) > 1 and not md.chunks[0].offsets:
                raise ValueError(f"{fqn!r}: {len(md.chunks)} different chunks stored for a scalar")
            hit = _ref_find_overlap(md.chunks, range(len(md.chunks[0].offsets)))
            if hit is not None:
                other, chunk = hit
                raise ValueError(
                    f"{fqn!r}: stored chunks overlap: offsets {list(other.offsets)} sizes {list(other.sizes)} "
                    f"and offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"
                )
    return Metadata(state_dict_metadata=sd)


# ------------------------------------------------------------------ random plans
@st.composite
def _plans(draw):
    world = draw(st.integers(1, 5))
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(draw(st.integers(1, 4))):
        fqn = draw(st.sampled_from(["a", "b.c", f"t{t}", "layers.1 x"]))
        if draw(st.integers(0, 5)) == 0:  # an object, on some ranks
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1)):
                per_rank[r].append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
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


@pytest.mark.parametrize("few_chunks", [save_planning._FEW_CHUNKS, 0], ids=["python-few", "torch-columns"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(plans=_plans(), to_minimum=st.booleans())
def test_columns_equal_the_per_item_reference(plans, to_minimum, few_chunks, monkeypatch):
    # both ways of building a tensor's metadata: plain Python for a few chunks, torch columns
    monkeypatch.setattr(save_planning, "_FEW_CHUNKS", few_chunks)
    fast = _outcome(dedup_save_plans, plans, to_minimum)
    ref = _outcome(_ref_dedup, plans, to_minimum)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "error":
        assert fast[1] == ref[1]
        return
    assert fast[1] == ref[1]
    # a rank that drops nothing keeps its plan object
    assert all((a is p) == (b is p) for a, b, p in zip(fast[1], ref[1], plans))
    for source in (plans, ref[1]):  # build_metadata also runs without dedup (use_collectives=False)
        fast_md = _outcome(build_metadata, source)
        ref_md = _outcome(_ref_build_metadata, source)
        assert fast_md[0] == ref_md[0], (fast_md, ref_md)
        if fast_md[0] == "error":
            assert fast_md[1] == ref_md[1]
            continue
        assert list(fast_md[1].state_dict_metadata) == list(ref_md[1].state_dict_metadata)
        assert fast_md[1].state_dict_metadata == ref_md[1].state_dict_metadata
        # (a chunk with fewer offsets than its tensor has dims is refused here, by both)
        assert _outcome(metadata_to_json, fast_md[1]) == _outcome(metadata_to_json, ref_md[1])


def test_metadata_chunks_are_built_only_when_read():
    plans = [SavePlan((WriteItem(MetadataIndex("w", (2 * r, 0)), WriteItemType.TENSOR, (2, 3), (8, 3), "float32",
                                 24),)) for r in (3, 1, 0, 2)]
    md = build_metadata(plans).state_dict_metadata["w"]
    assert "chunks" not in md.__dict__
    assert md.chunks == [ChunkStorageMetadata((2 * r, 0), (2, 3)) for r in range(4)]
    md.chunks.append(ChunkStorageMetadata((8, 0), (0, 3)))  # a plain list once read
    assert len(md.chunks) == 5


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
    return torch.tensor(kinds), torch.tensor(offsets), torch.tensor(sizes)


@settings(max_examples=300, deadline=None)
@given(rows=_tensors_of_boxes())
def test_grid_suspects_are_the_tensors_the_grid_test_does_not_clear(rows):
    # all tensors at once, as the per-tensor test answers for each
    kinds, offsets, sizes = rows
    expected = set()
    for kind in set(kinds.tolist()):
        mine = kinds == kind
        if not save_planning._grid_disjoint(offsets[mine], sizes[mine]):
            expected.add(kind)
    assert save_planning._grid_suspects(kinds, offsets, sizes) == expected
