"""A rank's write items as columns: what a save plan is on the wire.

:class:`WriteColumns` is an immutable ``Sequence[WriteItem]`` of a few int64 columns (2M
items gathered at 8192 ranks unpickle as a few byte strings); item objects are built only
when first read.  Exports :class:`WriteColumns`, the :data:`Kind` tuple and :data:`ROW`.
"""

from __future__ import annotations

import json
from array import array
from itertools import chain, islice
from typing import Any, Iterable, Iterator, Optional, Sequence, overload

import numpy as np

from .metadata import MetadataIndex
from .planner import WriteItem, WriteItemType

__all__ = ["ROW", "Kind", "WriteColumns"]

# (fqn, WriteItemType value, global shape or None, a tensor's dtype name or an object's
# digest or None): what the items of one FQN on one rank share.  A rank's plan names each
# kind once.
Kind = tuple[str, str, Optional[tuple[int, ...]], Optional[str]]

ROW = 4  # values per item in ``WriteColumns.rows``
_TENSOR = WriteItemType.TENSOR


def _lengths(values: Iterable[Optional[tuple[int, ...]]]) -> list[int]:
    return [-1 if v is None else len(v) for v in values]  # -1: None (an object's item)


class WriteColumns(Sequence[WriteItem]):
    """The write items of one plan as columns (an immutable ``Sequence[WriteItem]``).

    ``kinds``: the distinct :data:`Kind` tuples in order of first use; ``rows``: :data:`ROW`
    int64 per item (kind position, numbers of offsets and of sizes or ``-1`` for ``None``,
    ``nbytes``); ``offsets``/``sizes``: every item's integers end to end; ``picked``: the
    positions in the plan they were cut from, or ``None``.  Pickles as the columns.
    """

    __slots__ = ("_kinds", "_kinds_text", "rows", "offsets", "sizes", "picked", "_items")

    def __init__(self, kinds: Sequence[Kind] | str, rows: Any, offsets: Any, sizes: Any,
                 picked: Any = None, items: Optional[tuple[WriteItem, ...]] = None) -> None:
        self._kinds: Optional[tuple[Kind, ...]] = None if isinstance(kinds, str) else tuple(kinds)
        self._kinds_text: Optional[str] = kinds if isinstance(kinds, str) else None
        self.rows, self.offsets, self.sizes = _int_array(rows), _int_array(offsets), _int_array(sizes)
        if len(self.rows) % ROW:
            raise ValueError(f"WriteColumns: {len(self.rows)} row values is not a multiple of {ROW}")
        self.picked = None if picked is None else _int_array(picked)
        if self.picked is not None and len(self.picked) != len(self):
            raise ValueError("WriteColumns: picked positions and items differ in number")
        self._items = items

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The plan's kind table (decoded on first use)."""
        if self._kinds is None:
            assert self._kinds_text is not None
            self._kinds = tuple((fqn, kind_type, None if shape is None else tuple(shape), dtype)
                                for fqn, kind_type, shape, dtype in json.loads(self._kinds_text))
        return self._kinds

    @property
    def kinds_text(self) -> str:
        """The kind table as the JSON string it travels as (encoded on first use)."""
        if self._kinds_text is None:
            self._kinds_text = json.dumps(self.kinds, separators=(",", ":"))
        return self._kinds_text

    @classmethod
    def from_items(cls, items: Iterable[WriteItem]) -> WriteColumns:
        """The columns of ``items`` (kept as this object's items: nothing is rebuilt)."""
        items = tuple(items)
        kind_ids: dict[Kind, int] = {}
        kind = [kind_ids.setdefault((it.index.fqn, it.type.value, it.global_shape,
                                     it.dtype if it.type is _TENSOR else it.digest), len(kind_ids)) for it in items]
        offsets = [it.index.offset for it in items]
        sizes = [it.sizes for it in items]
        rows = array("q", chain.from_iterable(zip(kind, _lengths(offsets), _lengths(sizes), (it.nbytes for it in items))))
        return cls(list(kind_ids), rows, array("q", chain.from_iterable(filter(None, offsets))),
                   array("q", chain.from_iterable(filter(None, sizes))), items=items)

    @classmethod
    def of(cls, items: Sequence[WriteItem]) -> WriteColumns:
        """``items`` itself when it is columns, else its columns."""
        return items if isinstance(items, WriteColumns) else cls.from_items(items)

    def to_tuple(self) -> tuple[WriteItem, ...]:
        """The items as a tuple of ``WriteItem`` (built on first use, then kept)."""
        if self._items is None:
            # the last slot of a kind: a tensor's dtype, an object's digest
            kinds = [(fqn, WriteItemType(kind_type), shape, *((last, None) if kind_type == _TENSOR.value else (None, last)))
                     for fqn, kind_type, shape, last in self.kinds]
            offsets, sizes = iter(self.offsets), iter(self.sizes)
            out = []
            for kind, offset_ndim, size_ndim, nbytes in zip(*[iter(self.rows)] * ROW):
                fqn, kind_type, shape, dtype, digest = kinds[kind]
                offset = None if offset_ndim < 0 else tuple(islice(offsets, offset_ndim))
                size = None if size_ndim < 0 else tuple(islice(sizes, size_ndim))
                out.append(WriteItem(MetadataIndex(fqn, offset), kind_type, size, shape, dtype, nbytes, digest))
            self._items = tuple(out)
        return self._items

    def __len__(self) -> int:
        return len(self.rows) // ROW

    @overload
    def __getitem__(self, index: int) -> WriteItem: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[WriteItem, ...]: ...

    def __getitem__(self, index: int | slice) -> WriteItem | tuple[WriteItem, ...]:
        return self.to_tuple()[index]

    def __iter__(self) -> Iterator[WriteItem]:
        return iter(self.to_tuple())

    def reuse_items_of(self, source: WriteColumns) -> bool:
        """Take ``source``'s item objects when these columns are ``source``'s, or the cut of
        it that :attr:`picked` names (checked column by column); returns whether they were
        taken.  A rank's final plan is its local plan or such a cut: its own objects serve
        instead of being built again."""
        if self._items is not None or source._items is None or self.kinds_text != source.kinds_text:
            return False
        if self._columns() == source._columns():
            self._items = source._items
            return True
        if self.picked is None:
            return False
        pick = np.frombuffer(self.picked, dtype=np.int64)
        rows = np.frombuffer(source.rows, dtype=np.int64).reshape(-1, ROW)
        if pick.size and (int(pick.min()) < 0 or int(pick.max()) >= len(rows)):
            return False
        if not np.array_equal(rows[pick], np.frombuffer(self.rows, dtype=np.int64).reshape(-1, ROW)):
            return False
        for column, flat, mine in ((1, source.offsets, self.offsets), (2, source.sizes, self.sizes)):
            counts = np.maximum(rows[:, column], 0)
            kept = counts[pick]
            at = np.arange(int(kept.sum())) + np.repeat((np.cumsum(counts) - counts)[pick] - (np.cumsum(kept) - kept), kept)
            if not np.array_equal(np.frombuffer(flat, dtype=np.int64)[at], np.frombuffer(mine, dtype=np.int64)):
                return False
        self._items = tuple(map(source._items.__getitem__, pick.tolist()))
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WriteColumns):
            return self._columns() == other._columns() or self.to_tuple() == other.to_tuple()
        if isinstance(other, tuple):
            return self.to_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.to_tuple())

    def __repr__(self) -> str:
        return f"WriteColumns({list(self.to_tuple())!r})"

    def _columns(self) -> tuple:
        return self.kinds_text, self.rows.tobytes(), self.offsets.tobytes(), self.sizes.tobytes()

    def __reduce__(self) -> tuple:
        # the columns as bytes: a few strings to unpickle, plain types for safe_pickle
        return type(self), self._columns() + (None if self.picked is None else self.picked.tobytes(),)


def _int_array(values: Any) -> array:
    """``values`` (an int64 ``array``, the bytes of one, or ints) as an int64 ``array``."""
    return values if isinstance(values, array) and values.typecode == "q" else array("q", values)
