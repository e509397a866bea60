"""N-d chunk boxes and the pure geometry of sharding: :class:`ChunkBox` (a half-open box
``[offsets, offsets + sizes)`` in a global tensor), runs of indices along one dim, the
boxes of a flat range, and the row-major span arithmetic every reader uses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, product
from typing import Iterable, Sequence

__all__ = [
    "ChunkBox",
    "Run",
    "boxes_from_runs",
    "flat_range_to_boxes",
    "full_box",
    "runs_from_indices",
    "row_major_strides",
    "slice_span",
    "span_elements",
]


@dataclass(frozen=True, order=True)
class ChunkBox:
    """A half-open box ``[offsets, offsets + sizes)`` in a global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box rank mismatch: offsets={self.offsets} sizes={self.sizes}")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: ChunkBox) -> ChunkBox | None:
        """The overlap of two boxes, or ``None`` when they do not overlap."""
        lo = tuple(map(max, self.offsets, other.offsets))
        sizes = tuple(end - start for start, end in zip(lo, map(min, self.ends, other.ends)))
        return None if any(n <= 0 for n in sizes) else ChunkBox(lo, sizes)

    def contains(self, other: ChunkBox) -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            b <= a for a, b in zip(self.ends, other.ends))

    def relative_to(self, outer: ChunkBox) -> tuple[int, ...]:
        """Offsets of this box inside ``outer`` (which must contain it)."""
        return tuple(a - b for a, b in zip(self.offsets, outer.offsets))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(0 <= o and 0 <= s and o + s <= d
                                               for o, s, d in zip(self.offsets, self.sizes, shape))


def full_box(shape: Sequence[int]) -> ChunkBox:
    return ChunkBox(tuple(0 for _ in shape), tuple(int(d) for d in shape))


def row_major_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a contiguous row-major array of shape ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def slice_span(chunk_sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int, bool]:
    """``(first element, elements spanned, contiguous)`` of reading the sub-box
    ``offsets+lengths`` of a row-major chunk of shape ``chunk_sizes``: from the first element
    touched to the last (what the filesystem reader reads and ``hp-dcp explain`` predicts).
    An empty box spans nothing; a 0-d chunk one element.
    """
    if any(n == 0 for n in lengths):
        return 0, 0, True
    strides = row_major_strides(chunk_sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    span = sum((n - 1) * s for n, s in zip(lengths, strides)) + 1
    return first, span, span == math.prod(lengths)


def span_elements(chunk_sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """Elements spanned by reading the sub-box ``offsets+lengths`` (see ``slice_span``)."""
    return slice_span(chunk_sizes, offsets, lengths)[1]


# A run is a contiguous range of global indices along one dimension: (start, length).
Run = tuple[int, int]


def runs_from_indices(indices: Iterable[int]) -> list[Run]:
    """Compress sorted-or-not global indices (in local order) into contiguous runs."""
    runs: list[Run] = []
    for idx in indices:
        if runs and sum(runs[-1]) == idx:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((int(idx), 1))
    return runs


def boxes_from_runs(per_dim_runs: Sequence[Sequence[Run]]) -> list[tuple[ChunkBox, tuple[int, ...]]]:
    """Cartesian product of per-dimension runs: ``(global_box, local_offsets)`` pairs, the local
    tensor's dimension ``d`` being the concatenation of ``per_dim_runs[d]``.
    """
    per_dim = [[(start, length, local) for (start, length), local in zip(runs, accumulate((n for _, n in runs),
                                                                                         initial=0))]
               for runs in per_dim_runs]  # (global start, length, local start)
    return [(ChunkBox(tuple(e[0] for e in combo), tuple(e[1] for e in combo)), tuple(e[2] for e in combo))
            for combo in product(*per_dim)]


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[ChunkBox]:
    """The minimal boxes (at most ``2 * ndim - 1``, in flat order, each contiguous) whose union is
    the row-major flat range ``[start, end)``.
    """
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [ChunkBox((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    if inner == 0:
        return []
    first_row, last_row = start // inner, (end - 1) // inner
    rest_zeros = tuple(0 for _ in inner_shape)

    def prefixed(row: int, lo: int, hi: int) -> list[ChunkBox]:
        return [ChunkBox((row,) + b.offsets, (1,) + b.sizes) for b in flat_range_to_boxes(inner_shape, lo, hi)]

    if first_row == last_row:
        lo, hi = start - first_row * inner, end - first_row * inner
        if lo == 0 and hi == inner:
            return [ChunkBox((first_row,) + rest_zeros, (1,) + inner_shape)]
        return prefixed(first_row, lo, hi)
    boxes: list[ChunkBox] = []
    full_from = first_row
    if start % inner:
        boxes.extend(prefixed(first_row, start - first_row * inner, inner))
        full_from = first_row + 1
    full_to = end // inner  # exclusive
    if full_to > full_from:
        boxes.append(ChunkBox((full_from,) + rest_zeros, (full_to - full_from,) + inner_shape))
    if end % inner:
        boxes.extend(prefixed(full_to, 0, end - full_to * inner))
    return boxes
