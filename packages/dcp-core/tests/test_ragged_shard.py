"""RaggedShard: validation, its boxes, and the views a load writes through."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core import RaggedShard, flat_range_to_boxes, to_tensor_shards


def _flat_positions(shape: tuple[int, ...], boxes) -> list[int]:
    """Row-major flat indices of every element of ``boxes``, box after box (independent of the code)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out: list[int] = []
    for box in boxes:
        grids = torch.meshgrid(*[torch.arange(o, o + s) for o, s in zip(box.offsets, box.sizes)], indexing="ij")
        flat = sum(g * st_ for g, st_ in zip(grids, strides)) if grids else torch.tensor(0)
        out.extend(torch.as_tensor(flat).reshape(-1).tolist())
    return out


@st.composite
def ragged_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    total = math.prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=0, max_size=6)))
    points = [0, *cuts, total]
    # every other gap is a range this rank holds
    ranges = [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    return shape, ranges


@settings(max_examples=200, deadline=None)
@given(ragged_cases())
def test_ragged_pieces_are_views_of_the_ranges_in_order(case):
    shape, ranges = case
    global_tensor = torch.arange(math.prod(shape)).reshape(shape)
    local = torch.cat([global_tensor.reshape(-1)[s:e] for s, e in ranges]) if ranges else torch.empty(0, dtype=torch.int64)
    shard = RaggedShard(local.clone(), shape, ranges)
    shards = to_tensor_shards(shard, "w")
    assert shards.ragged and shards.global_shape == shape
    boxes = [box for box, _ in shards.pieces]
    expected = [i for s, e in ranges for i in range(s, e)]
    assert _flat_positions(shape, boxes) == expected
    for start, end in ranges:
        assert len(flat_range_to_boxes(shape, start, end)) <= 2 * len(shape) - 1
    for box, view in shards.pieces:
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        assert torch.equal(view, global_tensor[index])
        # writes through the view land in the caller's local tensor
        view.fill_(-1)
    assert bool((shard.local_tensor == -1).all()) or shard.local_tensor.numel() == 0


def test_from_rows_covers_the_rows_and_aliases_the_tensor():
    rows = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    shard = RaggedShard.from_rows(rows, (10, 4, 2), row_start=5)
    assert shard.flat_ranges == ((40, 64),)
    shards = to_tensor_shards(shard, "w")
    assert [(b.offsets, b.sizes) for b, _ in shards.pieces] == [((5, 0, 0), (3, 4, 2))]
    shards.pieces[0][1].zero_()
    assert float(rows.abs().sum()) == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(5), (4, 3), [(0, 6)]), "hold 6"),
        ((torch.zeros(4), (4, 3), [(3, 5), (4, 6)]), "sorted and disjoint"),
        ((torch.zeros(3), (4, 3), [(10, 13)]), "outside a tensor of 12"),
        ((torch.zeros(2, 2), (4, 3), [(0, 4)]), "must be 1-D"),
    ],
)
def test_invalid_ragged_shards_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        RaggedShard(*args)


def test_empty_rank_has_no_pieces():
    shards = to_tensor_shards(RaggedShard(torch.empty(0), (4, 3), []), "w")
    assert shards.pieces == []
    shards = to_tensor_shards(RaggedShard(torch.empty(0), (4, 3), [(5, 5)]), "w")
    assert shards.pieces == []
