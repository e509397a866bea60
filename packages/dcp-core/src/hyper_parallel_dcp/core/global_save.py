"""The coordinator's global save plan over columns (:func:`plan_global_columns`).

Every item is keyed by one int64 (its tensor's slot, then its offsets row-major over the global
shape + 1): one stable sort gives the dedup groups and chunk order, a grid test per dim clears
disjoint chunks.  What the keys cannot describe goes to :mod:`.save_reference`.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import replace
from itertools import accumulate
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .errors import CheckpointFormatError
from .metadata import (
    BytesStorageMetadata,
    ChunkTable,
    Metadata,
    TensorProperties,
    dtype_from_name,
    tensor_metadata_from_columns,
)
from .plan_columns import ROW, Kind, WriteColumns
from .planner import SavePlan, WriteItemType
from .save_reference import build_metadata_items, dedup_items, raise_overlap

__all__ = ["plan_global_columns"]

_KEY_LIMIT = 1 << 62  # the keys of every tensor's offsets must fit an int64
_TENSOR = WriteItemType.TENSOR.value


class _ItemByItem(Exception):
    """The plans go to the item-by-item reference (which raises the error, if any)."""


def plan_global_columns(plans: Sequence[SavePlan], *, dedup: bool, save_to_minimum_rank: bool,
                        metadata: bool = True) -> tuple[list[SavePlan], Optional[Metadata]]:
    """The plans after dedup (with ``dedup``) and, with ``metadata``, their metadata (else
    ``None``); returns and raises what ``save_reference.dedup_items`` and
    ``save_reference.build_metadata_items`` do."""
    columns = [WriteColumns.of(plan.items) for plan in plans]
    try:
        gathered = _Gathered(columns)
        keep = _dedup(gathered, save_to_minimum_rank) if dedup else None
    except _ItemByItem:
        out = dedup_items(plans, save_to_minimum_rank) if dedup else list(plans)
        return out, build_metadata_items(out) if metadata else None
    out = list(plans) if keep is None else _kept_plans(plans, columns, gathered, keep)
    return out, _metadata(gathered, keep) if metadata else None


class _Gathered:
    """Every plan's items end to end (item ``i`` of the whole save), with the global kind table."""

    def __init__(self, columns: Sequence[WriteColumns]) -> None:
        tables: dict[str, int] = {}  # the ranks of a job mostly share one table: compared as strings
        table_of_plan = [tables.setdefault(c.kinds_text, len(tables)) for c in columns]
        first_with = dict(zip(reversed(table_of_plan), range(len(columns) - 1, -1, -1)))  # table -> first plan
        kind_ids: dict[Kind, int] = {}
        table_map = [[kind_ids.setdefault(k, len(kind_ids)) for k in columns[first_with[t]].kinds]
                     for t in range(len(tables))]
        self.kinds = kinds = list(kind_ids)
        self.plans = len(columns)
        kinds_of = Counter(k[0] for k in kinds)
        if len(kinds_of) != len({k if k[1] == _TENSOR else k[:3] for k in kinds}):
            raise _ItemByItem  # an FQN with two kinds, shapes or dtypes
        # objects whose copies differ (several digests of one FQN): each rank's copy is kept
        self.per_rank = np.array([kinds_of[k[0]] > 1 for k in kinds], dtype=bool)
        width = max([len(k[2]) for k in kinds if k[2] is not None], default=0)
        self.kind_ndim = np.full(len(kinds), -1, dtype=np.int64)  # -1: an object
        self.properties: list[Any] = [None] * len(kinds)
        shapes, strides = np.zeros((2, len(kinds), width), dtype=np.int64)
        bases = np.zeros(len(kinds), dtype=np.int64)
        base = 0
        for k, (_, kind_type, shape, dtype) in enumerate(kinds):
            bases[k] = base
            span = 1
            if kind_type == _TENSOR:
                if shape is None or dtype is None:
                    raise _ItemByItem
                try:
                    self.properties[k] = TensorProperties(dtype_from_name(dtype))
                except CheckpointFormatError:
                    raise _ItemByItem from None
                self.kind_ndim[k] = len(shape)
                shapes[k, :len(shape)] = shape
                for dim in reversed(range(len(shape))):  # offsets may equal a dim: radix dim + 1
                    strides[k, dim] = span
                    span *= shape[dim] + 1
            base += span
        rows = _joined(c.rows for c in columns).reshape(-1, ROW)
        if base >= _KEY_LIMIT or not len(rows):
            raise _ItemByItem  # nothing to plan, or keys that would not fit an int64
        self.rank = rank = np.repeat(np.arange(len(columns)), [len(c) for c in columns])
        mapped = np.full((len(table_map), max(map(len, table_map)) + 1), -1, dtype=np.int64)
        for t, ids in enumerate(table_map):
            mapped[t, :len(ids)] = ids
        plan_table, local_kind = np.array(table_of_plan, dtype=np.int64)[rank], rows[:, 0]
        if ((local_kind < 0) | (local_kind >= mapped.shape[1])).any() or (mapped[plan_table, local_kind] < 0).any():
            raise ValueError("a plan's columns name a kind its table does not have")
        self.kind = kind = mapped[plan_table, local_kind]
        item_ndim = self.kind_ndim[kind]
        if not (np.array_equal(rows[:, 1], item_ndim) and np.array_equal(rows[:, 2], item_ndim)):
            raise _ItemByItem  # a chunk whose offsets or sizes do not match its tensor's dims
        self.rows, self.nbytes, self.ndim = rows, rows[:, 3], np.maximum(item_ndim, 0)
        self.flat_offsets = _joined(c.offsets for c in columns)
        self.flat_sizes = _joined(c.sizes for c in columns)
        per_plan = np.bincount(rank, weights=self.ndim, minlength=len(columns)).astype(np.int64).tolist()
        if per_plan != [len(c.offsets) for c in columns] or per_plan != [len(c.sizes) for c in columns]:
            raise ValueError("a plan's offsets or sizes do not match their per-item lengths")
        # items x widest dims, zero-padded, filled one dim at a time (few temporaries)
        self.offsets, self.sizes = np.zeros((2, len(kind), width), dtype=np.int64)
        key = bases[kind]
        first = np.cumsum(self.ndim) - self.ndim
        for dim in range(width):
            has = self.ndim > dim
            at = first[has] + dim
            self.offsets[has, dim], self.sizes[has, dim] = self.flat_offsets[at], self.flat_sizes[at]
            column = self.offsets[:, dim]
            if (column < 0).any() or (column > shapes[kind, dim]).any():
                raise _ItemByItem  # offsets outside the global shape: the key would not be one-to-one
            key += strides[kind, dim] * column
        # items in key order (stable: plan order among equal keys), and that order's keys
        self.order = np.argsort(key, kind="stable")
        self.sorted_key = key[self.order]


def _joined(arrays: Any) -> np.ndarray:
    """int64 ``array``s end to end as one numpy array (joined in C)."""
    return np.frombuffer(b"".join(arrays), dtype=np.int64)


def _dedup(g: _Gathered, save_to_minimum_rank: bool) -> np.ndarray | None:
    """Which items (in plan order) stay after dedup, or ``None`` when nothing is replicated."""
    count = len(g.sorted_key)
    starts = np.ones(count, dtype=bool)
    np.not_equal(g.sorted_key[1:], g.sorted_key[:-1], out=starts[1:])
    if g.per_rank.any():
        starts |= g.per_rank[g.kind[g.order]]
    if starts.all():
        return None
    repeated = np.flatnonzero(~starts)  # sorted positions whose item has the key of the one before
    if not np.array_equal(g.sizes[g.order[repeated]], g.sizes[g.order[repeated - 1]]):
        raise _ItemByItem  # two ranks hold different pieces at one key
    group = np.cumsum(starts) - 1
    first = g.order[starts]  # each group's first item (lowest plan)
    members = np.bincount(group)
    alone = g.order[members[group] == 1]
    planned = np.bincount(g.rank[alone], weights=g.nbytes[alone], minlength=g.plans)
    planned_bytes = planned.astype(np.int64).tolist()  # bytes each rank holds alone
    replicated = members >= 2
    rep_first, rep_members = first[replicated], members[replicated]
    rep_items = g.order[members[group] >= 2]  # grouped, each group in plan order: ranks ascend
    holder_ranks = g.rank[rep_items].tolist()
    rep_nbytes = g.nbytes[rep_first]
    # visited largest first, then in the global (fqn, offsets) order: by FQN, and inside
    # one tensor in key order (lexsort is stable)
    fqn_rank = np.empty(len(g.kinds), dtype=np.int64)
    fqn_rank[sorted(range(len(g.kinds)), key=lambda k: g.kinds[k][0])] = np.arange(len(g.kinds))
    visit = np.lexsort((fqn_rank[g.kind[rep_first]], -rep_nbytes)).tolist()
    begins = list(accumulate(rep_members.tolist(), initial=0))
    nbytes = rep_nbytes.tolist()
    chosen = [0] * len(nbytes)
    for r in visit:
        ranks = holder_ranks[begins[r]:begins[r + 1]]
        # the fewest bytes so far; min() keeps the first of equal ones: ties go to the lowest rank
        owner = ranks[0] if save_to_minimum_rank else min(ranks, key=planned_bytes.__getitem__)
        planned_bytes[owner] += nbytes[r]
        chosen[r] = owner
    keep = np.ones(count, dtype=bool)
    keep[rep_items] = g.rank[rep_items] == np.repeat(np.array(chosen, dtype=np.int64), rep_members)
    return keep


def _kept_plans(plans: Sequence[SavePlan], columns: Sequence[WriteColumns], g: _Gathered,
                keep: np.ndarray) -> list[SavePlan]:
    """Each plan with only its kept items; a plan that keeps every item is returned as is."""
    lengths = np.array([len(c) for c in columns], dtype=np.int64)
    kept = np.bincount(g.rank[keep], minlength=len(plans))
    whole = (kept == lengths).tolist()
    if all(whole):
        return list(plans)
    flat_keep = np.repeat(keep, g.ndim)
    rows, offsets, sizes = (_array(g.rows[keep]), _array(g.flat_offsets[flat_keep]),
                            _array(g.flat_sizes[flat_keep]))
    picked = _array((np.arange(len(keep)) - (np.cumsum(lengths) - lengths)[g.rank])[keep])
    item_ends = list(accumulate(kept.tolist(), initial=0))
    flat_ends = list(accumulate(np.bincount(g.rank[keep], weights=g.ndim[keep], minlength=len(plans))
                                .astype(np.int64).tolist(), initial=0))
    out = []
    for at, (plan, cols, all_kept) in enumerate(zip(plans, columns, whole)):
        if all_kept:
            out.append(plan)
            continue
        items, flat = slice(item_ends[at], item_ends[at + 1]), slice(flat_ends[at], flat_ends[at + 1])
        out.append(replace(plan, items=WriteColumns(cols.kinds_text, rows[item_ends[at] * ROW:item_ends[at + 1] * ROW],
                                                    offsets[flat], sizes[flat], picked[items])))
    return out


def _array(values: np.ndarray) -> array:
    """An int64 numpy array's values as an ``array``, what :class:`WriteColumns` holds (copied in C)."""
    return array("q", np.ascontiguousarray(values, dtype=np.int64).tobytes())


def _metadata(g: _Gathered, keep: np.ndarray | None) -> Metadata:
    """The metadata of the kept items (every item when ``keep`` is ``None``), checked as
    ``save_reference.build_metadata_items`` checks them."""
    kept_sorted = g.order if keep is None else g.order[keep[g.order]]  # by kind, then offsets
    sorted_kind = g.kind[kept_sorted]
    block_starts = np.flatnonzero(np.concatenate(([True], sorted_kind[1:] != sorted_kind[:-1])))
    block_kind = sorted_kind[block_starts].tolist()
    block_count = np.diff(block_starts, append=len(sorted_kind)).tolist()
    # keys in the order of their first kept item over the plans
    key_order = np.argsort(np.minimum.reduceat(kept_sorted, block_starts)).tolist()
    # per number of dims, every kept chunk's offsets and sizes in one flat list (one
    # tolist() per class, then a slice per tensor)
    sorted_ndim = g.kind_ndim[sorted_kind]
    classes: dict[int, tuple[list[int], list[int]]] = {}
    suspects: set[int] = set()  # tensors whose chunks the grid test does not clear
    for ndim in np.unique(sorted_ndim[block_starts]).tolist():
        if ndim < 0:
            continue
        rows = kept_sorted[sorted_ndim == ndim]
        offsets, sizes = g.offsets[rows, :ndim], g.sizes[rows, :ndim]
        classes[ndim] = offsets.ravel().tolist(), sizes.ravel().tolist()
        if ndim:
            suspects |= _grid_suspects(g.kind[rows], offsets, sizes)
    class_row = dict.fromkeys(classes, 0)
    first_row = []
    for k, count in zip(block_kind, block_count):
        ndim = int(g.kind_ndim[k])
        first_row.append(class_row.get(ndim, 0))
        if ndim >= 0:
            class_row[ndim] += count
    # per key: FQN, properties, shape, chunks, dims (-1: an object), offsets, sizes
    entries: list[tuple[str, Any, Any, int, int, list[int], list[int]]] = []
    for b in key_order:
        k, count = block_kind[b], block_count[b]
        fqn, _, shape, _ = g.kinds[k]
        ndim = int(g.kind_ndim[k])
        if ndim < 0:
            entries.append((fqn, None, None, 0, -1, [], []))
            continue
        all_offsets, all_sizes = classes[ndim]
        span = slice(first_row[b] * ndim, (first_row[b] + count) * ndim)
        entries.append((fqn, g.properties[k], shape, count, ndim, all_offsets[span], all_sizes[span]))
        if k in suspects or (not ndim and count > 1):
            raise_overlap(fqn, ChunkTable(ndim, count, all_offsets[span], all_sizes[span]))

    per_rank = [k[0] for k, differ in zip(g.kinds, g.per_rank.tolist()) if differ]
    return Metadata(state_dict_metadata={
        fqn: BytesStorageMetadata() if ndim < 0 else
        tensor_metadata_from_columns(fqn, properties, torch.Size(shape), count, ndim, offsets, sizes, ascending=True)
        for fqn, properties, shape, count, ndim, offsets, sizes in entries},
        rank_objects={fqn: {} for fqn in per_rank})


def _grid_suspects(kind: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> set[int]:
    """The ids in ``kind`` of the tensors whose chunks (rows, grouped by tensor and sorted) are not
    shown disjoint: on every dim, adjacent intervals by start must be equal or disjoint."""
    pairs = kind[1:] == kind[:-1]  # adjacent rows of one tensor
    if not pairs.any():
        return set()
    # one offset twice (a tensor's rows are sorted: next to each other)
    suspects = set(kind[:-1][pairs & (offsets[1:] == offsets[:-1]).all(1)].tolist())
    of_row = kind
    for dim in range(offsets.shape[1]):
        starts, lengths = offsets[:, dim], sizes[:, dim]
        if dim:  # by tensor, then by start on this dim
            by_start = np.lexsort((starts, kind))
            starts, lengths, of_row = starts[by_start], lengths[by_start], kind[by_start]
            pairs = of_row[1:] == of_row[:-1]
        same = (starts[1:] == starts[:-1]) & (lengths[1:] == lengths[:-1])
        suspects.update(of_row[:-1][pairs & (starts[:-1] + lengths[:-1] > starts[1:]) & ~same].tolist())
    return suspects

