"""Save planning: local write items, cross-rank dedup, the global metadata, the planner.

Local plan (one write item per local piece) → dedup across ranks (owner = fewest planned
bytes, or lowest rank) → metadata (chunks per tensor, checked pairwise disjoint).  All
functions but the planner class are pure: plain plans in, plain plans out.
"""

from __future__ import annotations

import contextlib
import math
import sys
from array import array
from dataclasses import replace
from itertools import accumulate, chain, compress, repeat
from operator import attrgetter, eq, is_, itemgetter
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import torch

from .chunks import ChunkBox, full_box
from .gc_pause import gc_paused
from .layout import _dtensor_boxes, check_tensor, is_tensor_leaf, to_tensor_shards
from .metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    dtype_from_name,
    dtype_name,
    tensor_metadata_from_columns,
)
from .plan_cache import PlanCache
from .plan_columns import _ROW, Kind, WriteColumns
from .planner import SavePlan, SavePlanner, WriteItem, WriteItemType, order_key
from .timing import log_info

__all__ = [
    "StandardSavePlanner",
    "build_metadata",
    "create_local_save_plan",
    "dedup_save_plans",
    "plan_global_save",
    "plan_global_save_deferred",
]


def create_local_save_plan(flat: dict[str, Any]) -> tuple[SavePlan, dict[MetadataIndex, Any], bool]:
    """Write items for a flattened state dict.

    Returns the plan, a map item index → data (tensor view or object), and whether a
    ragged leaf is present (which turns the plan cache off).
    """
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Any] = {}
    ragged = False
    module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = module.DTensor if module is not None else None
    # A model repeats a handful of layouts thousands of times: per (mesh, shape, dtype,
    # placements) the pieces' geometry and item fields are worked out once (~40% of the
    # local plan of 2000 sharded tensors went into the per-tensor DTensor calls).
    layouts: dict[tuple, Optional[tuple]] = {}
    for fqn, leaf in flat.items():
        if type(leaf) is dtensor_type:
            spec = leaf._spec
            key = (id(spec.mesh), spec.shape, leaf.dtype, spec.placements, leaf._local_tensor.shape)
            if key in layouts:
                layout = layouts[key]
            else:
                layout = layouts[key] = _dtensor_layout(leaf, fqn)
            if layout is not None:
                local = leaf._local_tensor
                check_tensor(local, fqn, meta=False)
                for offsets, sizes, global_shape, dtype, nbytes, narrow in layout:
                    view = local
                    for d, off, size in narrow:
                        view = view.narrow(d, off, size)
                    index = MetadataIndex(fqn, offsets)
                    if index in data:
                        raise ValueError(f"{fqn!r}: two local pieces start at offsets {offsets}")
                    items.append(WriteItem(index, WriteItemType.TENSOR, sizes, global_shape, dtype, nbytes))
                    data[index] = view
                continue
        if is_tensor_leaf(leaf):
            shards = to_tensor_shards(leaf, fqn, meta=False)
            ragged = ragged or shards.ragged
            dtype = dtype_name(shards.dtype)
            itemsize = shards.dtype.itemsize
            pieces = shards.pieces
            if math.prod(shards.global_shape) == 0:
                # A tensor with no elements has no chunk to store, but it must still be in
                # the metadata (with its shape): one empty full-size chunk, deduplicated.
                empty = full_box(shards.global_shape)
                pieces = [(empty, torch.empty(empty.sizes, dtype=shards.dtype))]
            for box, view in pieces:
                if box.is_empty() and box.volume != math.prod(shards.global_shape):
                    continue
                index = MetadataIndex(fqn, box.offsets)
                if index in data:
                    raise ValueError(f"{fqn!r}: two local pieces start at offsets {box.offsets}")
                items.append(WriteItem(index, WriteItemType.TENSOR, box.sizes, shards.global_shape, dtype,
                                       box.volume * itemsize))
                data[index] = view
        else:
            index = MetadataIndex(fqn)
            items.append(WriteItem(index, WriteItemType.BYTE_IO))
            data[index] = leaf
    return SavePlan(WriteColumns.from_items(items)), data, ragged


def _dtensor_layout(leaf: Any, fqn: str) -> Optional[tuple]:
    """The pieces of a DTensor with this layout as ``(offsets, sizes, global shape, dtype
    name, bytes, narrowing)`` each, as the general path of :func:`create_local_save_plan`
    makes them (the narrowing is :func:`~hyper_parallel_dcp.core.layout.to_tensor_shards`'s,
    to repeat on each tensor's local tensor); ``None`` for a tensor with no elements,
    which the general path handles.  Raises as ``to_tensor_shards`` does."""
    global_shape = tuple(leaf.shape)
    if math.prod(global_shape) == 0:
        return None
    dtype = dtype_name(leaf.dtype)
    itemsize = leaf.dtype.itemsize
    local_shape = leaf._local_tensor.shape
    pieces = []
    for box, local_offsets in _dtensor_boxes(leaf, fqn):
        if box.is_empty():
            continue
        narrow = tuple((d, off, size) for d, (off, size) in enumerate(zip(local_offsets, box.sizes))
                       if off or size != local_shape[d])
        pieces.append((box.offsets, box.sizes, global_shape, dtype, box.volume * itemsize, narrow))
    return tuple(pieces)



def dedup_save_plans(plans: Sequence[SavePlan], save_to_minimum_rank: bool = False) -> list[SavePlan]:
    """Keep each item held by several ranks on exactly one of them.

    Owner: the holder with the fewest bytes planned so far (ties → lowest rank), visiting
    replicated items largest first so the balance is good; or simply the lowest rank with
    ``save_to_minimum_rank=True``.  Deterministic for the same input.  A rank that drops
    nothing gets its plan object back; a rank that drops items gets its plan with the rest
    as :class:`~hyper_parallel_dcp.core.plan_columns.WriteColumns`.  Raises
    ``ValueError`` naming the key and both ranks when two ranks hold different pieces
    (sizes or kind) at one key.
    """
    return plan_global_save(plans, dedup=True, save_to_minimum_rank=save_to_minimum_rank, metadata=False)[0]


def _dedup_items(plans: Sequence[SavePlan], save_to_minimum_rank: bool = False) -> list[SavePlan]:
    """:func:`dedup_save_plans` item by item: the path for plans the columns cannot key
    (see :func:`_gather_columns`), and the one that words every error."""
    items = list(chain.from_iterable([plan.items for plan in plans]))
    # The one Python loop over every item of every rank (2M at 8192 simulated MoE
    # ranks), keyed by (fqn, offset) tuples hashed in C (MetadataIndex.__hash__ is a
    # Python call).  Value: [first item, position, position, ...], positions in ``items``.
    holders: dict[tuple, list[Any]] = {}
    get = holders.get
    for pos, item in enumerate(items):
        index = item.index
        key = (index.fqn, index.offset)
        entry = get(key)
        if entry is None:
            holders[key] = [item, pos]
            continue
        other = entry[0]
        if other.sizes != item.sizes or other.type != item.type:
            raise ValueError(
                f"{index.fqn!r}: ranks {_rank_at(plans, entry[1])} and {_rank_at(plans, pos)} hold different "
                f"pieces at offsets {index.offset} (sizes {other.sizes} vs {item.sizes})"
            )
        entry.append(pos)
    replicated = [(-entry[0].nbytes, order_key(entry[0].index), key) for key, entry in holders.items()
                  if len(entry) > 2]
    if not replicated:
        return list(plans)
    # The rest runs over whole columns in C: the loop above is the only per-item Python.
    with _one_torch_thread():
        lengths = [len(plan.items) for plan in plans]
        rank_of = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor(lengths))
        entries = holders.values()
        sole = list(map(eq, map(len, entries), repeat(2)))
        # bytes each rank holds alone, then the replicated items largest first
        planned = torch.zeros(len(plans), dtype=torch.int64).index_add_(
            0, rank_of[_int_column(map(_second, compress(entries, sole)))],
            _int_column(map(_nbytes, map(_first, compress(entries, sole))))).tolist()
        replicated.sort()
        positions = [holders[key][1:] for _, _, key in replicated]
        at = _int_column(chain.from_iterable(positions))
        holder_ranks = rank_of[at].tolist()
        chosen = []
        begin = 0
        for (neg_bytes, _, _), held in zip(replicated, positions):
            ranks = holder_ranks[begin:begin + len(held)]
            begin += len(held)
            # ranks ascend, and min() keeps the first of equal keys: ties go to the lowest rank
            owner = ranks[0] if save_to_minimum_rank else min(ranks, key=planned.__getitem__)
            planned[owner] -= neg_bytes
            chosen.append(owner)
        keep = torch.ones(len(items), dtype=torch.bool)
        keep[at] = rank_of[at] == torch.repeat_interleave(torch.tensor(chosen), torch.tensor(list(map(len, positions))))
        flags = keep.tolist()
    out = []
    start = 0
    for plan, length in zip(plans, lengths):
        mine = flags[start:start + length]
        start += length
        out.append(plan if all(mine) else replace(plan, items=tuple(compress(plan.items, mine))))
    return out


def _rank_at(plans: Sequence[SavePlan], position: int) -> int:
    """The rank whose plan holds the item at ``position`` of the concatenated plans."""
    for rank, plan in enumerate(plans):
        if position < len(plan.items):
            return rank
        position -= len(plan.items)
    raise IndexError(position)


_first = itemgetter(0)
_second = itemgetter(1)
_nbytes = attrgetter("nbytes")


def _sweep_overlap(order: list[ChunkStorageMetadata], dim: int) -> Optional[tuple[ChunkStorageMetadata, ...]]:
    """Pairwise sweep along ``dim`` over boxes sorted by their start on ``dim``."""
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


def _find_overlap(chunks: list[ChunkStorageMetadata], dims: Sequence[int]) -> Optional[tuple[ChunkStorageMetadata, ...]]:
    """Two chunks that overlap on every dim of ``dims``, or ``None``.

    Chunks with the same interval on the first dim form a slab, checked on the remaining
    dims; slabs with disjoint intervals cannot overlap.  Every DTensor layout is such a
    grid, so this is O(n log n) where a plain sweep is O(n · chunks per slab) — 2.7 s of
    3.6 s of global planning for the simulated 1024-rank MoE layout.  Intervals that
    partly overlap (ragged boxes) fall back to the pairwise sweep.
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
        last = slabs[-1][0] if slabs else None
        if last is not None and last.offsets[dim] == start and last.sizes[dim] == size:
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


def _grid_disjoint(offsets: torch.Tensor, sizes: torch.Tensor) -> bool:
    """True when the chunks (rows of ``offsets`` and ``sizes``, sorted by offsets) are
    provably pairwise disjoint as cells of a grid.

    If, on every dim, any two chunks use the same interval ``(offset, size)`` or disjoint
    ones, two chunks that differ on some dim are disjoint there, so two distinct chunks
    never overlap.  Every DTensor layout is such a grid: this is a sort per dim in C, where
    the slab search costs a Python call per slab (2.9 s of the 8192-rank MoE metadata
    build).  ``False`` means "not shown", not "overlapping".
    """
    if bool((offsets[1:] == offsets[:-1]).all(1).any()):
        return False  # one offset twice (sorted rows: next to each other)
    for dim in range(offsets.shape[1]):
        starts, lengths = offsets[:, dim], sizes[:, dim]
        if dim:
            by_start = torch.argsort(starts, stable=True)
            starts, lengths = starts[by_start], lengths[by_start]
        # sorted by start: an interval overlapping another overlaps the next one
        same = (starts[1:] == starts[:-1]) & (lengths[1:] == lengths[:-1])
        if bool(((starts[:-1] + lengths[:-1] > starts[1:]) & ~same).any()):
            return False
    return True


def _grid_suspects(kinds: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> set[int]:
    """The tensors, among many, that ``_grid_disjoint`` would not show disjoint: the ids in
    ``kinds`` (one per row of ``offsets`` and ``sizes``; each tensor's rows together,
    sorted by offsets) of those with two adjacent rows, in some dim's order, whose
    intervals differ and overlap.  Every other tensor's chunks are pairwise disjoint.

    The same test as ``_grid_disjoint`` for every tensor at once, a few sorts in C: one
    call per tensor cost ~10 us (the chunks built as objects and searched in Python),
    a tenth of a save of 1000 small tensors on 2 ranks.
    """
    same_kind = kinds[1:] == kinds[:-1]  # adjacent rows of one tensor
    if not bool(same_kind.any()):
        return set()
    # one offset twice (a tensor's rows are sorted: next to each other)
    suspects = set(kinds[:-1][same_kind & (offsets[1:] == offsets[:-1]).all(1)].tolist())
    for dim in range(offsets.shape[1]):
        starts, lengths, of_row, pairs = offsets[:, dim], sizes[:, dim], kinds, same_kind
        if dim:
            # by tensor, then by start on this dim (stable: the rows' order among equals)
            by_start = torch.argsort(starts, stable=True)
            by_start = by_start[torch.argsort(kinds[by_start], stable=True)]
            starts, lengths, of_row = starts[by_start], lengths[by_start], kinds[by_start]
            pairs = of_row[1:] == of_row[:-1]
        # sorted by start: an interval overlapping another overlaps the next one
        same = (starts[1:] == starts[:-1]) & (lengths[1:] == lengths[:-1])
        suspects.update(of_row[:-1][pairs & (starts[:-1] + lengths[:-1] > starts[1:]) & ~same].tolist())
    return suspects


def _check_disjoint(fqn: str, offsets: torch.Tensor, sizes: torch.Tensor) -> None:
    """Raise when two stored chunks of one tensor overlap.

    ``offsets`` and ``sizes``: int64, one row per chunk, rows sorted by offsets.
    """
    count, ndim = offsets.shape
    if count < 2:
        return
    if ndim == 0:
        raise ValueError(f"{fqn!r}: {count} different chunks stored for a scalar")
    if _grid_disjoint(offsets, sizes):
        return
    _raise_overlap(fqn, list(map(ChunkStorageMetadata, map(tuple, offsets.tolist()), map(tuple, sizes.tolist()))))


def _raise_overlap(fqn: str, chunks: list[ChunkStorageMetadata]) -> None:
    """Raise when two of one tensor's ``chunks`` (sorted by offsets) overlap."""
    if len(chunks) < 2:
        return
    ndim = len(chunks[0].offsets)
    if ndim == 0:
        raise ValueError(f"{fqn!r}: {len(chunks)} different chunks stored for a scalar")
    hit = _find_overlap(chunks, range(ndim))
    if hit is not None:
        other, chunk = hit
        raise ValueError(
            f"{fqn!r}: stored chunks overlap: offsets {list(other.offsets)} sizes {list(other.sizes)} "
            f"and offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"
        )


_item_row = attrgetter("index.fqn", "type", "global_shape", "dtype", "index.offset", "sizes")


_FEW_CHUNKS = 16  # up to this many chunks, a tensor's metadata is built in plain Python


def _int_column(values: Iterable[int]) -> torch.Tensor:
    """Python ints as an int64 tensor, copied in C (``torch.tensor`` converts one by one)."""
    buffer = array("q", values)
    return torch.frombuffer(buffer, dtype=torch.int64) if buffer else torch.zeros(0, dtype=torch.int64)


def build_metadata(plans: Sequence[SavePlan]) -> Metadata:
    """The global metadata (without storage data) for deduplicated plans.

    Keys appear in the order of their first item over the plans; a tensor's chunks are
    sorted by offsets (stable).  Raises ``ValueError`` when ranks disagree on a key's
    kind, shape or dtype (the first disagreement in plan order), when a tensor's chunks
    do not all have the same number of offsets and sizes, or when stored chunks of a
    tensor overlap.
    """
    metadata = plan_global_save(plans, dedup=False)[1]
    assert metadata is not None
    return metadata


def _build_metadata_items(plans: Sequence[SavePlan]) -> Metadata:
    """:func:`build_metadata` item by item (the path for plans the columns cannot key)."""
    # The items are read once, in plan order: the order the gathered plans were unpickled
    # into memory (visiting them grouped per FQN jumps across ranks; at 8192 simulated MoE
    # ranks, 602,441 items, that alone took seconds).  Offsets and sizes are copied into
    # int64 columns, then grouped, sorted and checked per FQN as tensors.  No object is
    # built per chunk: the metadata keeps the columns (``chunks`` is built on first read).
    items = list(chain.from_iterable([plan.items for plan in plans]))
    if not items:
        return Metadata(state_dict_metadata={})
    with _one_torch_thread():
        return _build_metadata(plans, items)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run torch's ops on this thread alone: planning makes many small tensors, and on a
    busy machine waking the intra-op pool for each cost more CPU than the work (1.5 s
    instead of 0.46 s of metadata build at 1024 simulated MoE ranks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _build_metadata(plans: Sequence[SavePlan], items: list[WriteItem]) -> Metadata:
    """:func:`build_metadata` of ``items``, the plans' items concatenated (not empty)."""
    fqns, types, shapes, dtypes, item_offsets, item_sizes = zip(*map(_item_row, items))
    offsets: Sequence[tuple[int, ...]] = item_offsets
    sizes: Sequence[tuple[int, ...]] = item_sizes
    group_of: list[int]
    first_at: dict[str, int] = {}
    group_of = list(map(first_at.setdefault, fqns, range(len(fqns))))  # position of the FQN's first item
    if len(set(zip(fqns, map(id, types), shapes, dtypes))) != len(first_at):
        _raise_first_conflict(plans)  # some FQN has two kinds, shapes or dtypes
    tensor_type = WriteItemType.TENSOR
    if types.count(tensor_type) != len(types):
        is_tensor = list(map(is_, types, repeat(tensor_type)))
        group_of = list(compress(group_of, is_tensor))
        offsets = list(compress(offsets, is_tensor))
        sizes = list(compress(sizes, is_tensor))
    ndims = list(map(len, offsets))
    if ndims != list(map(len, sizes)):
        at = next(i for i, (o, z) in enumerate(zip(offsets, sizes)) if len(o) != len(z))
        raise ValueError(f"{fqns[group_of[at]]!r}: a chunk has offsets {list(offsets[at])} but sizes "
                         f"{list(sizes[at])}")
    order = torch.argsort(_int_column(group_of), stable=True)  # grouped by FQN, plan order inside
    counts = iter(torch.unique_consecutive(_int_column(group_of)[order], return_counts=True)[1].tolist())
    ndim_column = _int_column(ndims)
    starts = torch.cumsum(ndim_column, 0) - ndim_column
    flat_offsets = _int_column(chain.from_iterable(offsets))
    flat_sizes = _int_column(chain.from_iterable(sizes))
    sd: dict[str, Any] = {}
    columns: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    few: dict[str, list[ChunkStorageMetadata]] = {}  # tensors checked in Python (few chunks)
    order_list = order.tolist()
    begin = 0
    for fqn, at in first_at.items():
        if types[at] is not tensor_type:
            sd[fqn] = BytesStorageMetadata()
            continue
        count = next(counts)
        first_offsets = items[at].index.offset
        assert first_offsets is not None  # a tensor item
        ndim = len(first_offsets)
        if count <= _FEW_CHUNKS:
            # A handful of chunks (every tensor of a small job): a dozen torch calls per
            # tensor would cost more than the work — 50 ms for 1000 tensors on 2 ranks.
            picked = order_list[begin:begin + count]
            begin += count
            if any(ndims[i] != ndim for i in picked):
                raise ValueError(f"{fqn!r}: chunks with {ndim} and with other numbers of offsets (the first at "
                                 f"{list(first_offsets)})")
            picked.sort(key=offsets.__getitem__)  # stable: tuple order, plan order among equals
            few[fqn] = [ChunkStorageMetadata(offsets[i], sizes[i]) for i in picked]
            sd[fqn] = tensor_metadata_from_columns(
                fqn, TensorProperties(dtype_from_name(dtypes[at])), torch.Size(shapes[at]), count, ndim,
                list(chain.from_iterable(map(offsets.__getitem__, picked))),
                list(chain.from_iterable(map(sizes.__getitem__, picked))), ascending=True)
            continue
        members = order[begin:begin + count]
        begin += count
        if bool((ndim_column[members] != ndim).any()):
            raise ValueError(f"{fqn!r}: chunks with {ndim} and with other numbers of offsets (the first at "
                             f"{list(first_offsets)})")
        where = starts[members].unsqueeze(1) + torch.arange(ndim)
        chunk_offsets, chunk_sizes = flat_offsets[where], flat_sizes[where]
        if count > 1 and ndim:
            perm = torch.arange(count)
            for dim in reversed(range(ndim)):  # stable passes, last dim first: tuple order, ties kept
                perm = perm[torch.argsort(chunk_offsets[perm, dim], stable=True)]
            chunk_offsets, chunk_sizes = chunk_offsets[perm], chunk_sizes[perm]
        columns[fqn] = chunk_offsets, chunk_sizes
        sd[fqn] = tensor_metadata_from_columns(fqn, TensorProperties(dtype_from_name(dtypes[at])),
                                               torch.Size(shapes[at]), count, ndim, chunk_offsets.flatten().tolist(),
                                               chunk_sizes.flatten().tolist(), ascending=True)
    for fqn in first_at:  # checked in key order, whichever way the chunks were sorted
        if fqn in columns:
            _check_disjoint(fqn, *columns[fqn])
        elif fqn in few:
            _raise_overlap(fqn, few[fqn])
    return Metadata(state_dict_metadata=sd)


def _raise_first_conflict(plans: Sequence[SavePlan]) -> None:
    """Raise the error for the first item, in plan order, whose kind, shape or dtype
    disagrees with the first item of its key (the slow walk, run only on a conflict)."""
    first: dict[str, tuple] = {}
    tensor_type = WriteItemType.TENSOR
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            seen = first.get(fqn)
            if item.type is not tensor_type:
                if seen is not None and seen[0]:
                    raise ValueError(f"{fqn!r} is a tensor on some ranks and an object on rank {rank}")
                first.setdefault(fqn, (False,))
                continue
            if seen is None:
                assert item.dtype is not None
                dtype_from_name(item.dtype)  # an unknown dtype is reported where it is first met
                first[fqn] = (True, item.global_shape, item.dtype)
            elif not seen[0]:
                raise ValueError(f"{fqn!r} is an object on some ranks and a tensor on rank {rank}")
            elif seen[1:] != (item.global_shape, item.dtype):
                assert item.global_shape is not None  # a tensor item
                raise ValueError(
                    f"{fqn!r} has global shape {list(seen[1])} / {dtype_name(dtype_from_name(seen[2]))} "
                    f"on one rank but {list(item.global_shape)} / {item.dtype} on rank {rank}"
                )
    raise AssertionError("no conflicting item found")  # pragma: no cover - the caller saw one


def plan_global_save(plans: Sequence[SavePlan], *, dedup: bool = True, save_to_minimum_rank: bool = False,
                     metadata: bool = True) -> tuple[list[SavePlan], Optional[Metadata]]:
    """The coordinator's save planning: :func:`dedup_save_plans` (with ``dedup``) and then
    :func:`build_metadata` of the result (with ``metadata``; else ``None``), in one pass.

    Runs over the plans' columns (:class:`WriteColumns`; a plan of item objects is turned
    into columns first) in C and torch: the items are grouped and sorted once, by one
    int64 key per item (the tensor's slot, then its offsets in row-major order of the
    global shape + 1), which gives both the dedup groups and each tensor's chunk order.
    Plans that such a key cannot describe exactly — an FQN with two kinds, shapes or
    dtypes, a chunk whose number of offsets or sizes is not its tensor's number of dims,
    offsets outside the global shape, different pieces at one key — go the item-by-item
    way, which raises the errors the functions document.  Returns the same plans, keys,
    chunk order and errors as :func:`_dedup_items` and :func:`_build_metadata_items`.
    """
    if not metadata:
        return _plan_global_save(plans, dedup, save_to_minimum_rank, False)[0], None
    out, build = plan_global_save_deferred(plans, dedup=dedup, save_to_minimum_rank=save_to_minimum_rank)
    with _one_torch_thread():
        return out, build()


def plan_global_save_deferred(plans: Sequence[SavePlan], *, dedup: bool = True, save_to_minimum_rank: bool = False
                              ) -> tuple[list[SavePlan], Callable[[], Metadata]]:
    """:func:`plan_global_save` in two halves: the plans now, checked as the metadata would
    be (the same errors, raised here), and a function that builds the metadata.

    The save pipeline sends the plans back at once and builds the metadata while the
    ranks write and fsync their data: the objects of 2000 tensors' metadata took 6 of the
    14 ms that every rank waited for its plan before writing a byte.
    """
    out, build = _plan_global_save(plans, dedup, save_to_minimum_rank, True)
    assert build is not None
    return out, build


def _plan_global_save(plans: Sequence[SavePlan], dedup: bool, save_to_minimum_rank: bool,
                      metadata: bool) -> tuple[list[SavePlan], Optional[Callable[[], Metadata]]]:
    columns = [WriteColumns.of(plan.items) for plan in plans]
    with _one_torch_thread():
        gathered = _gather_columns(columns)
        try:
            keep = _dedup_columns(gathered, save_to_minimum_rank) if gathered is not None and dedup else None
        except _PiecesDiffer:
            gathered = None
        if gathered is None:
            out = _dedup_items(plans, save_to_minimum_rank) if dedup else list(plans)
            if not metadata:
                return out, None
            built = _build_metadata_items(out)
            return out, lambda: built
        out = list(plans) if keep is None else _kept_plans(plans, columns, gathered, keep)
        return out, (_metadata_of_columns(gathered, keep) if metadata else None)


class _PiecesDiffer(Exception):
    """Two ranks hold different pieces at one key (the item path words the error)."""


class _Gathered:
    """Every plan's columns laid end to end (item ``i`` of the whole save), as int64
    tensors, with the global kind table.  Built only for plans a key can describe."""

    def __init__(self, plans: int, kinds: list[Kind], kind: torch.Tensor, rank: torch.Tensor, rows: torch.Tensor,
                 ndim: torch.Tensor, flat: tuple[torch.Tensor, torch.Tensor], offsets: torch.Tensor,
                 sizes: torch.Tensor, key: torch.Tensor, kind_ndim: list[int]) -> None:
        self.plans = plans
        self.kinds = kinds  # global kind table; a kind is one FQN here
        self.kind = kind  # per item: global kind id
        self.rank = rank  # per item: position of its plan
        self.rows = rows  # per item: its plan's row (kind id in its own table, ndims, nbytes)
        self.nbytes = rows[:, 3]
        self.flat_offsets, self.flat_sizes = flat  # as the plans carry them, end to end
        self.ndim = ndim  # per item: number of offsets (= of sizes = of its tensor's dims; 0 for objects)
        self.offsets = offsets  # items × max dims, zero-padded
        self.sizes = sizes
        self.kind_ndim = kind_ndim  # per kind: dims of its tensor, -1 for objects
        # items in key order (stable: plan order among equal keys), and that order's keys
        self.sorted_key, self.order = torch.sort(key, stable=True)


def _cat(arrays: Iterable[array]) -> torch.Tensor:
    """int64 ``array``s end to end as one tensor (joined in C)."""
    buffer = bytearray().join(arrays)  # one copy, into a writable buffer torch can wrap
    return torch.frombuffer(buffer, dtype=torch.int64) if buffer else torch.zeros(0, dtype=torch.int64)


_rows_of = attrgetter("rows")
_offsets_of = attrgetter("offsets")
_sizes_of = attrgetter("sizes")


def _gather_columns(columns: Sequence[WriteColumns]) -> Optional[_Gathered]:
    """The plans' columns as one :class:`_Gathered`, or ``None`` when a key cannot
    describe them (see :func:`plan_global_save`)."""
    tables: dict[str, int] = {}  # ranks of one job mostly share one table: compared as strings
    table_of_plan = [tables.setdefault(c.kinds_text, len(tables)) for c in columns]
    first_with = dict(zip(reversed(table_of_plan), reversed(range(len(columns)))))
    kind_ids: dict[Kind, int] = {}
    table_map = [[kind_ids.setdefault(k, len(kind_ids)) for k in columns[first_with[t]].kinds]
                 for t in range(len(tables))]
    kinds = list(kind_ids)
    if len({k[0] for k in kinds}) != len(kinds):
        return None  # an FQN with two kinds, shapes or dtypes: the item path words the error
    tensor_type = WriteItemType.TENSOR.value
    kind_ndim, bases, strides, shapes = [], [], [], []
    base = 0
    width = max([len(k[2]) for k in kinds if k[2] is not None], default=0)
    for _, kind_type, shape, dtype in kinds:
        if kind_type == tensor_type:
            if shape is None or dtype is None:
                return None
            stride, span = [], 1
            for dim in reversed(shape):  # row-major over the global shape + 1 (offsets may equal a dim)
                stride.append(span)
                span *= dim + 1
            kind_ndim.append(len(shape))
            strides.append(stride[::-1] + [0] * (width - len(shape)))
            shapes.append(list(shape) + [0] * (width - len(shape)))
        else:
            span = 1
            kind_ndim.append(-1)
            strides.append([0] * width)
            shapes.append([0] * width)
        bases.append(base)
        base += span
    if base >= 1 << 62 or not kinds:
        return None  # the keys would not fit an int64
    lengths = torch.tensor(list(map(len, columns)), dtype=torch.int64)
    rank = torch.repeat_interleave(torch.arange(len(columns)), lengths)
    rows = _cat(map(_rows_of, columns)).reshape(-1, 4)
    local_kind, offset_ndim, size_ndim, _ = rows.unbind(1)
    if len(table_map) == 1:  # one table for every rank (the usual case): the ids are global ids
        if len(local_kind) and (int(local_kind.min()) < 0 or int(local_kind.max()) >= len(table_map[0])):
            raise ValueError("a plan's columns name a kind its table does not have")
        kind = local_kind.contiguous()
    else:
        table_len = torch.tensor([len(t) for t in table_map], dtype=torch.int64)
        table_width = max(map(len, table_map), default=0)
        mapped = torch.tensor([t + [0] * (table_width - len(t)) for t in table_map], dtype=torch.int64)
        plan_table = torch.tensor(table_of_plan, dtype=torch.int64)[rank]
        if bool(((local_kind < 0) | (local_kind >= table_len[plan_table])).any()):
            raise ValueError("a plan's columns name a kind its table does not have")
        kind = mapped[plan_table, local_kind]
    # per item, only what one pass needs is gathered from the kind tables, and the
    # temporaries are updated in place: each items × dims int64 temporary is a fresh
    # allocation the kernel must fault in (8192-16384 simulated ranks of an MoE job, 2-4M
    # items: 0.4-1.8 s of system time for the faults, on top of 1-2.2 s of planning)
    item_ndim = torch.tensor(kind_ndim, dtype=torch.int64)[kind]
    if not (torch.equal(offset_ndim, item_ndim) and torch.equal(size_ndim, item_ndim)):
        return None  # a chunk whose offsets or sizes do not match its tensor's dims
    ndim = item_ndim.clamp_(min=0)
    flat_offsets, flat_sizes = _cat(map(_offsets_of, columns)), _cat(map(_sizes_of, columns))
    per_plan = torch.zeros(len(columns), dtype=torch.int64).index_add_(0, rank, ndim).tolist()
    if per_plan != list(map(len, map(_offsets_of, columns))) or per_plan != list(map(len, map(_sizes_of, columns))):
        raise ValueError("a plan's offsets or sizes do not match their per-item lengths")
    dims = torch.arange(width)
    inside = dims < ndim.unsqueeze(1)
    where = (torch.cumsum(ndim, 0).sub_(ndim).unsqueeze(1) + dims).clamp_(max=max(len(flat_offsets) - 1, 0))
    if len(flat_offsets):
        offsets, sizes = flat_offsets[where].mul_(inside), flat_sizes[where].mul_(inside)
    else:
        offsets = sizes = torch.zeros((), dtype=torch.int64).expand(len(kind), width)
    del where, inside
    if len(offsets) and width:
        if int(offsets.min()) < 0:
            return None  # offsets outside the global shape: the key would not be one-to-one
        highest = torch.zeros(len(kinds), width, dtype=torch.int64).scatter_reduce_(
            0, kind.unsqueeze(1).expand(-1, width), offsets, "amax")
        if not bool(torch.le(highest, torch.tensor(shapes, dtype=torch.int64).reshape(len(kinds), width)).all()):
            return None
    key = torch.tensor(bases, dtype=torch.int64)[kind]
    stride_table = torch.tensor(strides, dtype=torch.int64).reshape(len(kinds), width)
    for dim in range(width):
        key.add_(stride_table[:, dim][kind].mul_(offsets[:, dim]))
    return _Gathered(len(columns), kinds, kind, rank, rows, ndim, (flat_offsets, flat_sizes), offsets, sizes, key,
                     kind_ndim)


def _dedup_columns(g: _Gathered, save_to_minimum_rank: bool) -> Optional[torch.Tensor]:
    """Which items (in plan order) stay after dedup: a bool tensor, or ``None`` when
    nothing is replicated.  Raises :class:`_PiecesDiffer` when two ranks hold different
    pieces at one key."""
    count = len(g.sorted_key)
    if count < 2:
        return None
    starts_group = torch.ones(count, dtype=torch.bool)
    starts_group[1:] = g.sorted_key[1:] != g.sorted_key[:-1]
    if bool(starts_group.all()):
        return None
    group = torch.cumsum(starts_group, 0) - 1
    first = g.order[starts_group]  # each group's first item (lowest plan)
    sorted_sizes = g.sizes[g.order]
    if not bool((sorted_sizes == g.sizes[first][group]).all()):
        raise _PiecesDiffer
    members = torch.bincount(group)
    held_alone = (members == 1)[group]
    planned = torch.zeros(g.plans, dtype=torch.int64).index_add_(
        0, g.rank[g.order[held_alone]], g.nbytes[g.order[held_alone]]).tolist()
    replicated = members >= 2
    rep_first = first[replicated]
    rep_members = members[replicated].tolist()
    rep_items = g.order[~held_alone]  # grouped, each group in plan order: ranks ascend
    holder_ranks = g.rank[rep_items].tolist()
    rep_kind = g.kind[rep_first].tolist()
    rep_ndim = g.ndim[rep_first].tolist()
    rep_offsets = g.offsets[rep_first].tolist()
    rep_nbytes = g.nbytes[rep_first].tolist()
    begins = list(accumulate(rep_members, initial=0))
    # largest first, then the global (fqn, offsets) order of chunk keys
    visit = sorted(range(len(rep_members)), key=lambda r: (-rep_nbytes[r], g.kinds[rep_kind[r]][0],
                                                           rep_offsets[r][:rep_ndim[r]]))
    chosen = [0] * len(rep_members)
    for r in visit:
        ranks = holder_ranks[begins[r]:begins[r + 1]]
        # ranks ascend, and min() keeps the first of equal keys: ties go to the lowest rank
        owner = ranks[0] if save_to_minimum_rank else min(ranks, key=planned.__getitem__)
        planned[owner] += rep_nbytes[r]
        chosen[r] = owner
    keep = torch.ones(count, dtype=torch.bool)
    keep[rep_items] = g.rank[rep_items] == torch.repeat_interleave(torch.tensor(chosen, dtype=torch.int64),
                                                                   torch.tensor(rep_members, dtype=torch.int64))
    return keep


def _as_array(values: torch.Tensor) -> array:
    """An int64 tensor's values as an ``array`` (one copy in C)."""
    return array("q", values.contiguous().numpy().tobytes())


def _kept_plans(plans: Sequence[SavePlan], columns: Sequence[WriteColumns], g: _Gathered,
                keep: torch.Tensor) -> list[SavePlan]:
    """Each plan with only its kept items (its own kind table and order); a plan that
    keeps every item is returned as is."""
    kept_per_plan = torch.zeros(len(plans), dtype=torch.int64).index_add_(0, g.rank, keep.long())
    whole = (kept_per_plan == torch.tensor(list(map(len, columns)), dtype=torch.int64)).tolist()
    if all(whole):
        return list(plans)
    flat_keep = torch.repeat_interleave(keep, g.ndim)
    rows = _as_array(g.rows[keep])
    offsets = _as_array(g.flat_offsets[flat_keep])
    sizes = _as_array(g.flat_sizes[flat_keep])
    plan_start = torch.cumsum(torch.tensor(list(map(len, columns)), dtype=torch.int64), 0) - torch.tensor(
        list(map(len, columns)), dtype=torch.int64)
    picked = _as_array((torch.arange(len(keep)) - plan_start[g.rank])[keep])
    item_ends = list(accumulate(kept_per_plan.tolist(), initial=0))
    row_ends = [end * _ROW for end in item_ends]
    flat_ends = list(accumulate(torch.zeros(len(plans), dtype=torch.int64).index_add_(
        0, g.rank[keep], g.ndim[keep]).tolist(), initial=0))
    out = []
    for at, (plan, cols, all_kept) in enumerate(zip(plans, columns, whole)):
        if all_kept:
            out.append(plan)
            continue
        flat = slice(flat_ends[at], flat_ends[at + 1])
        out.append(replace(plan, items=WriteColumns(cols.kinds_text, rows[row_ends[at]:row_ends[at + 1]],
                                                    offsets[flat], sizes[flat],
                                                    picked[item_ends[at]:item_ends[at + 1]])))
    return out


def _metadata_of_columns(g: _Gathered, keep: Optional[torch.Tensor]) -> Callable[[], Metadata]:
    """:func:`build_metadata` of the kept items (every item when ``keep`` is ``None``): the
    chunks are checked now, the metadata is built by the function returned."""
    count = len(g.kind)
    if not count:
        return lambda: Metadata(state_dict_metadata={})
    kept_sorted = g.order if keep is None else g.order[keep[g.order]]  # by kind, then offsets
    positions = torch.arange(count) if keep is None else torch.nonzero(keep).flatten()
    kinds = g.kinds
    first = torch.full((len(kinds),), count, dtype=torch.int64).scatter_reduce_(
        0, g.kind[positions], positions, "amin")
    used = (first < count).tolist()
    key_order = [k for k in torch.argsort(first, stable=True).tolist() if used[k]]
    chunk_count = torch.bincount(g.kind[kept_sorted], minlength=len(kinds)).tolist()
    # per number of dims, every kept chunk's offsets and sizes (rows in key order, grouped
    # by kind id), as tensors and as flat Python lists: one tolist() per class, then a
    # slice per tensor (a dozen torch calls per tensor would cost more than the work for
    # a small job's thousand tensors)
    classes: dict[int, tuple[torch.Tensor, torch.Tensor, list[int], list[int]]] = {}
    first_row: dict[int, int] = {}
    # tensors whose chunks may overlap (every other tensor's are shown disjoint, all at once)
    suspects: set[int] = set()
    sorted_ndim = torch.tensor(g.kind_ndim, dtype=torch.int64)[g.kind[kept_sorted]]
    for ndim in sorted({g.kind_ndim[k] for k in range(len(kinds)) if used[k]}):
        if ndim < 0:
            continue
        rows = kept_sorted[sorted_ndim == ndim]
        offsets, sizes = g.offsets[rows, :ndim], g.sizes[rows, :ndim]
        classes[ndim] = offsets, sizes, offsets.flatten().tolist(), sizes.flatten().tolist()
        if ndim:
            suspects |= _grid_suspects(g.kind[rows], offsets, sizes)
        at = 0
        for k in range(len(kinds)):
            if used[k] and g.kind_ndim[k] == ndim:
                first_row[k] = at
                at += chunk_count[k]
    # per key: FQN, shape, dtype, chunks, dims (-1: an object), offsets, sizes
    entries: list[tuple[str, Any, Any, int, int, list[int], list[int]]] = []
    for k in key_order:
        fqn, _, shape, dtype = kinds[k]
        ndim = g.kind_ndim[k]
        if ndim < 0:
            entries.append((fqn, None, None, 0, -1, [], []))
            continue
        assert shape is not None and dtype is not None
        chunks, begin = chunk_count[k], first_row[k]
        offset_rows, size_rows, all_offsets, all_sizes = classes[ndim]
        chunk_offsets = all_offsets[begin * ndim:(begin + chunks) * ndim]
        chunk_sizes = all_sizes[begin * ndim:(begin + chunks) * ndim]
        entries.append((fqn, shape, dtype, chunks, ndim, chunk_offsets, chunk_sizes))
        if ndim and k not in suspects:
            continue
        if chunks <= _FEW_CHUNKS:
            _raise_overlap(fqn, [ChunkStorageMetadata(tuple(chunk_offsets[i:i + ndim]),
                                                      tuple(chunk_sizes[i:i + ndim]))
                                 for i in range(0, chunks * ndim, ndim)] if ndim else
                           [ChunkStorageMetadata((), ())] * chunks)
        else:
            _check_disjoint(fqn, offset_rows[begin:begin + chunks], size_rows[begin:begin + chunks])

    def build() -> Metadata:
        sd: dict[str, Any] = {}
        for fqn, shape, dtype, chunks, ndim, chunk_offsets, chunk_sizes in entries:  # key order
            if ndim < 0:
                sd[fqn] = BytesStorageMetadata()
            else:
                sd[fqn] = tensor_metadata_from_columns(fqn, TensorProperties(dtype_from_name(dtype)),
                                                       torch.Size(shape), chunks, ndim, chunk_offsets, chunk_sizes,
                                                       ascending=True)
        return Metadata(state_dict_metadata=sd)

    return build


class StandardSavePlanner(SavePlanner):
    """Default save planner: cross-rank dedup and a process-wide plan cache.

    ``enable_plan_caching``: the final plan and metadata are cached per set of state-dict
    keys (in :attr:`plan_cache`); a later save with the same keys skips local planning,
    the gather and the global plan.  ``remove_redundancy``: replicated chunks are written
    once.  Both are off with ``use_collectives=False``; the cache is off when a ragged
    leaf is present.
    """

    plan_cache: PlanCache = PlanCache()

    #: ``resolve_data`` returns views of the state dict being saved, which stays unchanged
    #: until the write returns: a sync save blocks its caller, and an async save's writer
    #: reads the staging slab, which the next save refills only after this one has landed.
    #: A subclass that overrides ``resolve_data`` gets False unless it declares otherwise.
    resolved_data_stable = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "resolve_data" in vars(cls) and "resolved_data_stable" not in vars(cls):
            cls.resolved_data_stable = False

    def __init__(self, enable_plan_caching: bool = True, remove_redundancy: bool = True,
                 save_to_minimum_rank: bool = False) -> None:
        self.enable_plan_caching = enable_plan_caching
        self.remove_redundancy = remove_redundancy
        self.save_to_minimum_rank = save_to_minimum_rank
        self.flat: dict[str, Any] = {}
        self.is_coordinator = True
        self.rank = 0
        self.world_size = 1
        self.use_collectives = True
        self.cache_hit = False
        self._reset_state()

    def _reset_state(self) -> None:
        self._data: dict[MetadataIndex, Any] = {}
        self._local_plan: Optional[SavePlan] = None
        self._ragged = False

    @classmethod
    def clear_cache(cls) -> None:
        """Forget every cached plan of this process."""
        cls.plan_cache.clear()

    def without_state(self) -> StandardSavePlanner:
        """A copy with the same options and no per-save state (no reference to any tensor)."""
        fresh = type(self).__new__(type(self))
        fresh.__dict__.update(self.__dict__)
        fresh.flat = {}
        fresh.cache_hit = False
        fresh._reset_state()
        return fresh

    def set_up_planner(self, state_dict: dict[str, Any], *, is_coordinator: bool, rank: int = 0,
                       world_size: int = 1, use_collectives: bool = True) -> None:
        self.flat = state_dict
        self.is_coordinator = is_coordinator
        self.rank = rank
        self.world_size = world_size
        self.use_collectives = use_collectives
        self._local_plan = None
        self.cache_hit = False

    def _ensure_local(self) -> SavePlan:
        if self._local_plan is None:
            self._local_plan, self._data, self._ragged = create_local_save_plan(self.flat)
        return self._local_plan

    def cache_key(self) -> Hashable:
        """The plan-cache key of the state dict set up last (keys, rank, world, options)."""
        return (type(self).__name__, frozenset(self.flat), self.rank, self.world_size,
                self.remove_redundancy, self.save_to_minimum_rank)

    def _fingerprint(self) -> tuple:
        return tuple((it.index, it.sizes, it.global_shape, it.dtype) for it in self._ensure_local().items
                     if it.type is WriteItemType.TENSOR)

    @property
    def caching(self) -> bool:
        """Whether this save may use and fill the plan cache (plans are not cached without
        collectives, nor for a state dict with a ragged leaf)."""
        return self.enable_plan_caching and self.use_collectives and not self.has_ragged

    def lookup_cached_plan(self) -> Optional[tuple[SavePlan, Optional[Metadata]]]:
        if not (self.enable_plan_caching and self.use_collectives):
            return None
        entry = self.plan_cache.lookup(self.cache_key())
        if entry is None or self.has_ragged:
            return None
        plan, metadata, fingerprint = entry
        if fingerprint != self._fingerprint():
            # Same keys, another layout (a resharded model, a second model with the same
            # names): plan again; cache_plan then replaces the entry.
            log_info(self.rank, "Plan cache entry does not match the state dict's layout; planning again.")
            return None
        # The save pipeline sets cache_hit once every rank agrees on using the entry.
        return plan, metadata

    def cache_plan(self, final_plan: SavePlan, metadata: Optional[Metadata]) -> None:
        if self.caching:
            self.plan_cache.store(self.cache_key(), (final_plan, metadata, self._fingerprint()))

    def create_local_plan(self) -> SavePlan:
        return self._ensure_local()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with gc_paused():
            plans, metadata = plan_global_save(all_plans, dedup=self.remove_redundancy and self.use_collectives,
                                               save_to_minimum_rank=self.save_to_minimum_rank)
            assert metadata is not None
            return plans, metadata

    def create_global_plan_deferred(self, all_plans: list[SavePlan]
                                    ) -> tuple[list[SavePlan], Callable[[], Metadata]]:
        if type(self).create_global_plan is not StandardSavePlanner.create_global_plan:
            return super().create_global_plan_deferred(all_plans)  # a subclass's own global plan
        with gc_paused():
            return plan_global_save_deferred(all_plans, dedup=self.remove_redundancy and self.use_collectives,
                                             save_to_minimum_rank=self.save_to_minimum_rank)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        local = self._local_plan
        if local is not None and isinstance(new_plan.items, WriteColumns) and isinstance(local.items, WriteColumns):
            # the final plan is the local plan or a cut of it: the rank's own item objects
            # serve, instead of being built again from the columns
            new_plan.items.reuse_items_of(local.items)
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        self._ensure_local()
        return self._data[write_item.index]

    @property
    def has_ragged(self) -> bool:
        self._ensure_local()
        return self._ragged
