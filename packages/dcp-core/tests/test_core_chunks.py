"""Chunk-box geometry: tables with hand-computed answers, and properties checked against
element masks / ``torch.arange`` materialisations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import (
    ChunkBox,
    boxes_from_runs,
    flat_range_to_boxes,
    full_box,
    runs_from_indices,
    span_elements,
)

B = ChunkBox

INTERSECT_TABLE = [
    # a, b, expected intersection
    (B((0, 0), (4, 4)), B((2, 2), (4, 4)), B((2, 2), (2, 2))),
    (B((0, 0), (4, 4)), B((4, 0), (2, 4)), None),  # touching edge: no overlap
    (B((0, 0), (4, 4)), B((1, 1), (2, 2)), B((1, 1), (2, 2))),  # containment
    (B((0,), (10,)), B((9,), (5,)), B((9,), (1,))),
    (B((0, 0, 0), (2, 3, 4)), B((1, 2, 3), (5, 5, 5)), B((1, 2, 3), (1, 1, 1))),
    (B((0, 0), (4, 0)), B((0, 0), (4, 4)), None),  # an empty box overlaps nothing
    (B((), ()), B((), ()), B((), ())),  # scalars
]


@pytest.mark.parametrize(("a", "b", "expected"), INTERSECT_TABLE)
def test_intersect_table(a, b, expected):
    assert a.intersect(b) == expected
    assert b.intersect(a) == expected


CONTAINS_TABLE = [
    (B((0, 0), (4, 4)), B((1, 1), (2, 2)), True),
    (B((0, 0), (4, 4)), B((0, 0), (4, 4)), True),
    (B((0, 0), (4, 4)), B((3, 3), (2, 1)), False),
    (B((2,), (3,)), B((1,), (1,)), False),
    (B((2,), (3,)), B((4,), (1,)), True),
]


@pytest.mark.parametrize(("outer", "inner", "expected"), CONTAINS_TABLE)
def test_contains_table(outer, inner, expected):
    assert outer.contains(inner) is expected


def test_volume_ends_and_emptiness():
    assert B((1, 2), (3, 4)).volume == 12
    assert B((1, 2), (3, 4)).ends == (4, 6)
    assert B((), ()).volume == 1  # a scalar holds one element
    assert B((0, 5), (3, 0)).volume == 0 and B((0, 5), (3, 0)).is_empty()
    assert not B((0,), (1,)).is_empty()
    assert full_box((3, 0, 2)) == B((0, 0, 0), (3, 0, 2))
    assert B((2, 3), (1, 1)).relative_to(B((1, 1), (4, 4))) == (1, 2)
    assert B((2, 3), (1, 1)).within((3, 4)) and not B((2, 3), (2, 1)).within((3, 4))
    with pytest.raises(ValueError, match="rank mismatch"):
        B((0, 0), (1,))


def _mask(box: ChunkBox, shape) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    m[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = True
    return m


@st.composite
def _box_in(draw, shape):
    offsets, sizes = [], []
    for d in shape:
        lo = draw(st.integers(0, d))
        hi = draw(st.integers(lo, d))
        offsets.append(lo)
        sizes.append(hi - lo)
    return B(tuple(offsets), tuple(sizes))


@st.composite
def _two_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    return shape, draw(_box_in(shape)), draw(_box_in(shape))


@settings(max_examples=200, deadline=None)
@given(_two_boxes())
def test_intersect_and_contains_agree_with_element_masks(case):
    shape, a, b = case
    ma, mb = _mask(a, shape), _mask(b, shape)
    inter = a.intersect(b)
    both = ma & mb
    if inter is None:
        assert not both.any()
    else:
        assert torch.equal(_mask(inter, shape), both)
        assert inter.volume == int(both.sum())
    if not b.is_empty():
        assert a.contains(b) == bool(not (mb & ~ma).any())
    assert a.volume == int(ma.sum())


@st.composite
def _flat_ranges(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    end = draw(st.integers(start, total))
    return shape, start, end


@settings(max_examples=400, deadline=None)
@given(_flat_ranges())
def test_flat_range_to_boxes_is_an_ordered_exact_cover(case):
    """Each box is a contiguous run of flat indices; in order they concatenate to the range."""
    shape, start, end = case
    boxes = flat_range_to_boxes(shape, start, end)
    flat = torch.arange(math.prod(shape)).view(shape)
    got: list[int] = []
    for box in boxes:
        assert box.within(shape) and not box.is_empty()
        piece = flat[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(-1).tolist()
        # contiguous in flat order, so a 1-D buffer of the range splits box by box
        assert piece == list(range(piece[0], piece[0] + len(piece)))
        got.extend(piece)
    assert got == list(range(start, end))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


FLAT_TABLE = [
    # shape, start, end, expected boxes
    ((4, 6), 0, 24, [B((0, 0), (4, 6))]),
    ((4, 6), 6, 18, [B((1, 0), (2, 6))]),
    ((4, 6), 3, 21, [B((0, 3), (1, 3)), B((1, 0), (2, 6)), B((3, 0), (1, 3))]),
    ((4, 6), 2, 4, [B((0, 2), (1, 2))]),
    ((2, 3, 4), 5, 19, [B((0, 1, 1), (1, 1, 3)), B((0, 2, 0), (1, 1, 4)), B((1, 0, 0), (1, 1, 4)),
                        B((1, 1, 0), (1, 1, 3))]),
    ((2, 3, 4), 1, 23, [B((0, 0, 1), (1, 1, 3)), B((0, 1, 0), (1, 2, 4)), B((1, 0, 0), (1, 2, 4)),
                        B((1, 2, 0), (1, 1, 3))]),
    ((5,), 1, 4, [B((1,), (3,))]),
    ((), 0, 1, [B((), ())]),
    ((3, 3), 4, 4, []),
]


@pytest.mark.parametrize(("shape", "start", "end", "expected"), FLAT_TABLE)
def test_flat_range_to_boxes_table(shape, start, end, expected):
    assert flat_range_to_boxes(shape, start, end) == expected


def test_flat_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match=r"\[3, 13\).*12 elements"):
        flat_range_to_boxes((3, 4), 3, 13)


SPAN_TABLE = [
    # chunk sizes, offsets, lengths, spanned elements
    ((4, 6), (1, 0), (2, 6), 12),  # whole rows: exactly themselves
    ((4, 6), (0, 2), (4, 1), 19),  # one column spans every row it touches: 2 .. 3*6+2
    ((4, 6), (1, 1), (2, 2), 8),  # 7..14
    ((4, 6), (0, 0), (0, 6), 0),
    ((10,), (3,), (4,), 4),
    ((2, 3, 4), (0, 0, 3), (2, 3, 1), 21),  # 3 .. 23
]


@pytest.mark.parametrize(("sizes", "offsets", "lengths", "expected"), SPAN_TABLE)
def test_span_elements_table(sizes, offsets, lengths, expected):
    assert span_elements(sizes, offsets, lengths) == expected


def test_runs_and_boxes_from_runs():
    assert runs_from_indices([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 2), (9, 1)]
    assert runs_from_indices([]) == []
    out = boxes_from_runs([[(0, 2), (4, 1)], [(1, 3)]])
    assert out == [(B((0, 1), (2, 3)), (0, 0)), (B((4, 1), (1, 3)), (2, 0))]
