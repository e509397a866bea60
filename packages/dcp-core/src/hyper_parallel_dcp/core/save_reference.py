"""The global save plan one ``WriteItem`` at a time: the reference :mod:`.global_save`'s
columns must equal; it plans what the columns cannot describe and words every error.
Exports :func:`dedup_items`, :func:`build_metadata_items`, :func:`raise_overlap`.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import chain
from typing import Any, Optional, Sequence, cast

import torch

from .chunks import ChunkBox
from .metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    dtype_from_name,
    dtype_name,
    tensor_metadata_from_columns,
)
from .planner import SavePlan, WriteItem, WriteItemType, order_key

__all__ = ["build_metadata_items", "dedup_items", "raise_overlap"]


def dedup_items(plans: Sequence[SavePlan], save_to_minimum_rank: bool = False) -> list[SavePlan]:
    """Keep each item that several ranks hold on one of them (as ``dedup_save_plans`` does)."""
    holders: dict[tuple, list[Any]] = {}  # (fqn, offsets) -> [first item, rank, rank, ...]
    per_rank = _per_rank_objects(plans)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key: tuple = (item.index.fqn, item.index.offset)
            if item.index.fqn in per_rank:
                key += (rank,)  # differing copies: each rank keeps its own
            entry = holders.setdefault(key, [item])
            first = entry[0]
            if first.sizes != item.sizes or first.type != item.type:
                raise ValueError(
                    f"{item.index.fqn!r}: ranks {entry[1]} and {rank} hold different pieces at offsets "
                    f"{item.index.offset} (sizes {first.sizes} vs {item.sizes})"
                )
            entry.append(rank)
    planned = [0] * len(plans)  # bytes each rank writes
    replicated = []
    for key, entry in holders.items():
        if len(entry) == 2:
            planned[entry[1]] += entry[0].nbytes
        else:
            replicated.append((-entry[0].nbytes, order_key(entry[0].index), key))
    replicated.sort()  # largest first, then the global order
    dropped: dict[int, set[tuple]] = {}
    for neg_bytes, _, key in replicated:
        ranks = holders[key][1:]
        # the fewest bytes so far; min() keeps the first of equal ones: ties go to the lowest rank
        owner = ranks[0] if save_to_minimum_rank else min(ranks, key=planned.__getitem__)
        planned[owner] -= neg_bytes
        for rank in ranks:
            if rank != owner:
                dropped.setdefault(rank, set()).add(key)
    return [replace(plan, items=tuple(it for it in plan.items if (it.index.fqn, it.index.offset) not in gone))
            if (gone := dropped.get(rank)) else plan for rank, plan in enumerate(plans)]


def _per_rank_objects(plans: Sequence[SavePlan]) -> dict[str, None]:
    """The object FQNs whose copies differ (items with several digests), in order of first use."""
    digests: dict[str, set[Optional[str]]] = {}
    for plan in plans:
        for item in plan.items:
            if item.type is WriteItemType.BYTE_IO:
                digests.setdefault(item.index.fqn, set()).add(item.digest)
    return {fqn: None for fqn, found in digests.items() if len(found) > 1}


def build_metadata_items(plans: Sequence[SavePlan]) -> Metadata:
    """The metadata of deduplicated plans (as ``build_metadata`` gives, with the same errors)."""
    first: dict[str, WriteItem] = {}  # key order: the first item of each FQN over the plans
    chunks: dict[str, list[ChunkStorageMetadata]] = {}
    bad: Optional[tuple[str, ChunkStorageMetadata]] = None  # the first chunk whose offsets and sizes differ in number
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            seen = first.setdefault(fqn, item)
            is_tensor = item.type is WriteItemType.TENSOR
            if seen is item and is_tensor:
                assert item.dtype is not None
                dtype_from_name(item.dtype)  # an unknown dtype is reported where it is first met
            elif (seen.type is WriteItemType.TENSOR) != is_tensor:
                kinds = ("a tensor", "an object") if is_tensor else ("an object", "a tensor")
                raise ValueError(f"{fqn!r} is {kinds[1]} on some ranks and {kinds[0]} on rank {rank}")
            elif (seen.global_shape, seen.dtype) != (item.global_shape, item.dtype):
                assert seen.global_shape is not None and seen.dtype is not None and item.global_shape is not None
                raise ValueError(
                    f"{fqn!r} has global shape {list(seen.global_shape)} / {dtype_name(dtype_from_name(seen.dtype))} "
                    f"on one rank but {list(item.global_shape)} / {item.dtype} on rank {rank}"
                )
            if is_tensor:
                chunk = ChunkStorageMetadata(cast(tuple, item.index.offset), cast(tuple, item.sizes))
                chunks.setdefault(fqn, []).append(chunk)
                if bad is None and len(chunk.offsets) != len(chunk.sizes):
                    bad = fqn, chunk
    if bad is not None:
        raise ValueError(f"{bad[0]!r}: a chunk has offsets {list(bad[1].offsets)} but sizes {list(bad[1].sizes)}")
    for fqn, found in chunks.items():
        ndim = len(found[0].offsets)
        if any(len(c.offsets) != ndim for c in found):
            raise ValueError(f"{fqn!r}: chunks with {ndim} and with other numbers of offsets (the first at "
                             f"{list(found[0].offsets)})")
        found.sort(key=lambda c: c.offsets)  # stable: plan order among equal offsets
    for fqn, found in chunks.items():  # checked in key order
        raise_overlap(fqn, found)
    sd: dict[str, Any] = {}
    for fqn, item in first.items():
        if item.type is not WriteItemType.TENSOR:
            sd[fqn] = BytesStorageMetadata()
            continue
        found = chunks[fqn]
        assert item.dtype is not None and item.global_shape is not None
        sd[fqn] = tensor_metadata_from_columns(
            fqn, TensorProperties(dtype_from_name(item.dtype)), torch.Size(item.global_shape), len(found),
            len(found[0].offsets), list(chain.from_iterable(c.offsets for c in found)),
            list(chain.from_iterable(c.sizes for c in found)), ascending=True)
    return Metadata(state_dict_metadata=sd, rank_objects={fqn: {} for fqn in _per_rank_objects(plans)})


def raise_overlap(fqn: str, chunks: Sequence[ChunkStorageMetadata]) -> None:
    """Raise ``ValueError`` naming two of one tensor's ``chunks`` (sorted by offsets) that
    overlap, or saying that a scalar has several chunks; return when they are disjoint."""
    if len(chunks) < 2:
        return
    ndim = len(chunks[0].offsets)
    if ndim == 0:
        raise ValueError(f"{fqn!r}: {len(chunks)} different chunks stored for a scalar")
    hit = _find_overlap(list(chunks), tuple(range(ndim)))
    if hit is not None:
        other, chunk = hit
        raise ValueError(
            f"{fqn!r}: stored chunks overlap: offsets {list(other.offsets)} sizes {list(other.sizes)} "
            f"and offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"
        )


_Pair = Optional[tuple[ChunkStorageMetadata, ChunkStorageMetadata]]


def _find_overlap(chunks: list[ChunkStorageMetadata], dims: tuple[int, ...]) -> _Pair:
    """Two chunks that overlap on every dim of ``dims``, or ``None``: chunks with the same
    interval on the first dim form a slab searched on the other dims; partly overlapping
    intervals fall back to a sweep.
    """
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
            return _sweep_overlap(order, dim)
        slabs.append([chunk])
        reach = start + size
    for members in slabs:
        hit = _find_overlap(members, dims[1:])
        if hit is not None:
            return hit
    return None


def _sweep_overlap(order: list[ChunkStorageMetadata], dim: int) -> _Pair:
    """The first overlapping pair of a sweep along ``dim`` over chunks sorted by their start there."""
    active: list[ChunkStorageMetadata] = []
    for chunk in order:
        start = chunk.offsets[dim]
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > start]
        box = ChunkBox(chunk.offsets, chunk.sizes)
        for other in active:
            if box.intersect(ChunkBox(other.offsets, other.sizes)) is not None:
                return other, chunk
        active.append(chunk)
    return None
