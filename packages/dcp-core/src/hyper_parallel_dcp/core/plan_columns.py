"""A rank's write items as columns: what a save plan is on the wire.

At 8192 simulated MoE ranks the coordinator gathers about 2M write items.  As
:class:`~hyper_parallel_dcp.core.planner.WriteItem` objects, unpickling them, one Python
pass over them and reading their fields cost seconds (3.0-3.3 s CPU of dedup and
metadata build, before the unpickle); as a handful of integer columns per rank they
unpickle as a few byte strings, and the coordinator's dedup and metadata build run over
whole columns in C.

:class:`WriteColumns` is an immutable sequence of ``WriteItem``: code that iterates,
indexes or compares ``SavePlan.items`` keeps working, and the item objects are built only
when first read (a rank builds its own, a few hundred; the coordinator builds none).
A custom planner's plan of item tuples is turned into columns by the coordinator
(:meth:`WriteColumns.of`), so both kinds of plans mix in one save.
"""

from __future__ import annotations

import json
from array import array
from itertools import chain, islice
from operator import attrgetter
from typing import Any, Iterable, Iterator, Optional, Sequence, overload

import numpy as np

from .metadata import MetadataIndex
from .planner import WriteItem, WriteItemType

__all__ = ["Kind", "WriteColumns"]

# (fqn, WriteItemType value, global shape or None, dtype name or None): what the items of
# one FQN on one rank share.  A rank's plan names each kind once.
Kind = tuple[str, str, Optional[tuple[int, ...]], Optional[str]]

_NONE = -1  # an offset or sizes column entry for ``None`` (a pickled object's item)
_ROW = 4  # values per item in ``WriteColumns.rows``
_kind_of = attrgetter("index.fqn", "type.value", "global_shape", "dtype")
_offset_of = attrgetter("index.offset")
_sizes_of = attrgetter("sizes")
_nbytes_of = attrgetter("nbytes")


def _lengths(values: Iterable[Optional[tuple[int, ...]]]) -> list[int]:
    return [_NONE if v is None else len(v) for v in values]


def _int_array(values: Any) -> array:
    """``values`` (an ``array``, the bytes of one, or ints) as an int64 ``array``."""
    if isinstance(values, array) and values.typecode == "q":
        return values
    return array("q", values)


def _encode_kinds(kinds: Sequence[Kind]) -> str:
    return json.dumps(kinds, separators=(",", ":"))


def _decode_kinds(text: str) -> tuple[Kind, ...]:
    return tuple((fqn, kind_type, None if shape is None else tuple(shape), dtype)
                 for fqn, kind_type, shape, dtype in json.loads(text))


class WriteColumns(Sequence[WriteItem]):
    """The write items of one plan as columns (an immutable ``Sequence[WriteItem]``).

    ``kinds``: the distinct :data:`Kind` tuples, in order of first use; ``rows``: four
    int64 per item — the position of its kind in ``kinds``, its number of offsets and of
    sizes (``-1`` for ``None``) and its ``nbytes``; ``offsets`` and ``sizes``: every
    item's integers end to end.  Equal to another ``WriteColumns`` or a tuple with the
    same items; pickles as the columns only (never the item objects), with ``kinds`` as
    one JSON string, so that the coordinator compares the tables of 8192 ranks as 8192
    strings and decodes only the different ones.
    """

    __slots__ = ("_kinds", "_kinds_text", "rows", "offsets", "sizes", "picked", "_items")

    def __init__(self, kinds: Sequence[Kind] | str, rows: Any, offsets: Any, sizes: Any,
                 picked: Any = None, items: Optional[tuple[WriteItem, ...]] = None) -> None:
        self._kinds: Optional[tuple[Kind, ...]] = None if isinstance(kinds, str) else tuple(kinds)
        self._kinds_text: Optional[str] = kinds if isinstance(kinds, str) else None
        self.rows = _int_array(rows)
        self.offsets = _int_array(offsets)
        self.sizes = _int_array(sizes)
        # (the flat columns' lengths are checked where they are read, over all plans at once)
        if len(self.rows) % _ROW:
            raise ValueError(f"WriteColumns: {len(self.rows)} row values is not a multiple of {_ROW}")
        # positions of these items in the plan they were cut from (the coordinator's dedup
        # keeps a subsequence of each rank's plan), or None
        self.picked = None if picked is None else _int_array(picked)
        if self.picked is not None and len(self.picked) != len(self):
            raise ValueError("WriteColumns: picked positions and items differ in number")
        self._items = items

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The plan's kind table (decoded on first use)."""
        if self._kinds is None:
            assert self._kinds_text is not None
            self._kinds = _decode_kinds(self._kinds_text)
        return self._kinds

    @property
    def kinds_text(self) -> str:
        """The kind table as the JSON string it travels as (encoded on first use)."""
        if self._kinds_text is None:
            assert self._kinds is not None
            self._kinds_text = _encode_kinds(self._kinds)
        return self._kinds_text

    @classmethod
    def from_items(cls, items: Iterable[WriteItem]) -> WriteColumns:
        """The columns of ``items`` (kept as this object's item tuple: nothing is rebuilt)."""
        items = tuple(items)
        kind_ids: dict[Kind, int] = {}
        kind = [kind_ids.setdefault(k, len(kind_ids)) for k in map(_kind_of, items)]
        offsets = list(map(_offset_of, items))
        sizes = list(map(_sizes_of, items))
        rows = array("q", chain.from_iterable(zip(kind, _lengths(offsets), _lengths(sizes), map(_nbytes_of, items))))
        return cls(list(kind_ids), rows, array("q", chain.from_iterable(filter(None, offsets))),
                   array("q", chain.from_iterable(filter(None, sizes))), items=items)

    @classmethod
    def of(cls, items: Sequence[WriteItem]) -> WriteColumns:
        """``items`` itself when it is columns, else its columns (one pass over the items)."""
        return items if isinstance(items, WriteColumns) else cls.from_items(items)

    def _build(self) -> tuple[WriteItem, ...]:
        kinds = [(fqn, WriteItemType(kind_type), shape, dtype) for fqn, kind_type, shape, dtype in self.kinds]
        offsets, sizes = iter(self.offsets), iter(self.sizes)
        out = []
        for kind, offset_ndim, size_ndim, nbytes in zip(*[iter(self.rows)] * _ROW):
            fqn, kind_type, shape, dtype = kinds[kind]
            offset = None if offset_ndim < 0 else tuple(islice(offsets, offset_ndim))
            size = None if size_ndim < 0 else tuple(islice(sizes, size_ndim))
            out.append(WriteItem(MetadataIndex(fqn, offset), kind_type, size, shape, dtype, nbytes))
        return tuple(out)

    def to_tuple(self) -> tuple[WriteItem, ...]:
        """The items as a tuple of ``WriteItem`` (built on first use, then kept)."""
        if self._items is None:
            self._items = self._build()
        return self._items

    def __len__(self) -> int:
        return len(self.rows) // _ROW

    @overload
    def __getitem__(self, index: int) -> WriteItem: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[WriteItem, ...]: ...

    def __getitem__(self, index: int | slice) -> WriteItem | tuple[WriteItem, ...]:
        return self.to_tuple()[index]

    def __iter__(self) -> Iterator[WriteItem]:
        return iter(self.to_tuple())

    def same_columns(self, other: WriteColumns) -> bool:
        """Whether ``other`` holds the very same columns (then the same items), compared
        without building any item."""
        return self._columns() == other._columns()

    def reuse_items_of(self, source: WriteColumns) -> bool:
        """Take ``source``'s item objects when these columns are ``source``'s, or the cut
        of it that :attr:`picked` names (checked column by column, in C); returns whether
        they were taken.  A rank's final plan is its local plan or such a cut: its own
        objects serve instead of being built again (1000 items: ~4 ms)."""
        if self._items is not None or source._items is None or self.kinds_text != source.kinds_text:
            return False
        if self.same_columns(source):
            self._items = source._items
            return True
        if self.picked is None:
            return False
        pick = np.frombuffer(self.picked, dtype=np.int64)
        rows = np.frombuffer(source.rows, dtype=np.int64).reshape(-1, _ROW)
        if pick.size and (int(pick.min()) < 0 or int(pick.max()) >= len(rows)):
            return False
        if not np.array_equal(rows[pick], np.frombuffer(self.rows, dtype=np.int64).reshape(-1, _ROW)):
            return False
        for column, flat, mine in ((1, source.offsets, self.offsets), (2, source.sizes, self.sizes)):
            counts = np.maximum(rows[:, column], 0)
            starts = np.cumsum(counts) - counts
            kept = counts[pick]
            at = np.arange(int(kept.sum())) + np.repeat(starts[pick] - (np.cumsum(kept) - kept), kept)
            if not np.array_equal(np.frombuffer(flat, dtype=np.int64)[at], np.frombuffer(mine, dtype=np.int64)):
                return False
        self._items = tuple(map(source._items.__getitem__, pick.tolist()))
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WriteColumns):
            return self.same_columns(other) or self.to_tuple() == other.to_tuple()
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
        # the columns as bytes: a few strings to unpickle, and only plain types for the
        # async mailbox's allow-listed unpickler
        return type(self), self._columns() + (None if self.picked is None else self.picked.tobytes(),)
