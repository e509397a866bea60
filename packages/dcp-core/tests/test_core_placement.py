"""``placement_boxes`` / ``to_tensor_shards`` against torch's own DTensor sharding.

The reference is torch itself: in one process, a "fake" process group plays each rank in
turn and ``distribute_tensor(..., src_data_rank=None)`` cuts the local shard out of a
``torch.arange`` global tensor with DTensor's own semantics (no communication).  The boxes
our geometry reports must pick exactly those global elements, in local order.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel_dcp.core.errors import UnsupportedPlacementError
from hyper_parallel_dcp.core.layout import placement_boxes, to_tensor_shards


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_local_shards(global_shape, mesh_shape, placements):
    """Per rank: (mesh coordinate, local tensor) as DTensor cuts them from an arange."""
    world = math.prod(mesh_shape)
    full = torch.arange(math.prod(global_shape), dtype=torch.int64).view(global_shape)
    out = []
    for rank in range(world):
        with _fake_rank(rank, world):
            mesh = init_device_mesh("cpu", tuple(mesh_shape))
            dt = distribute_tensor(full, mesh, list(placements), src_data_rank=None)
            out.append((tuple(mesh.get_coordinate()), dt.to_local().clone()))
    return full, out


def _materialise(full: torch.Tensor, boxes, local_shape) -> torch.Tensor:
    """Fill a local tensor from the global one through (box, local offset) pairs."""
    out = torch.full(tuple(local_shape), -1, dtype=full.dtype)
    for box, local_off in boxes:
        src = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        dst = tuple(slice(o, o + s) for o, s in zip(local_off, box.sizes))
        out[dst] = full[src]
    return out


def _check_layout(global_shape, mesh_shape, placements) -> None:
    full, locals_ = _torch_local_shards(global_shape, mesh_shape, placements)
    for coord, local in locals_:
        boxes = placement_boxes(global_shape, mesh_shape, coord, placements)
        volume = sum(box.volume for box, _ in boxes)
        assert volume == local.numel(), (coord, placements, boxes, local)
        assert all(box.within(global_shape) for box, _ in boxes)
        got = _materialise(full, boxes, local.shape)
        assert torch.equal(got, local), f"{placements} at {coord}: boxes {boxes} give {got} but torch holds {local}"


TABLE = [
    # (global shape, mesh shape, placements)
    ((8, 6), (4,), [Shard(0)]),
    ((8, 6), (4,), [Shard(1)]),
    ((10, 3), (4,), [Shard(0)]),  # uneven: 3, 3, 3, 1
    ((10, 3), (3,), [Shard(0)]),  # uneven: 4, 4, 2
    ((2, 5), (4,), [Shard(0)]),  # ranks 2 and 3 hold nothing
    ((7, 5), (4,), [Shard(-1)]),
    ((6, 4), (3,), [Replicate()]),
    ((8, 6), (2, 2), [Shard(0), Shard(1)]),
    ((8, 6), (2, 2), [Replicate(), Shard(1)]),
    ((9, 6), (2, 2), [Shard(0), Shard(0)]),  # the same dim sharded twice
    ((5,), (2, 2), [Shard(0), Replicate()]),
    # FSDP2 + TP: TP shards dim d first, FSDP then shards each TP piece (right to left)
    ((8, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((7, 5), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((7, 5), (2, 2), [_StridedShard(0, split_factor=2), Shard(1)]),
    ((11, 4), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
    ((6, 10), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)]),
    ((12, 4), (2, 2, 2), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),
    ((3, 4, 5), (2, 2), [Shard(2), Shard(1)]),
    ((), (2,), [Replicate()]),
]


@pytest.mark.parametrize(("global_shape", "mesh_shape", "placements"), TABLE,
                         ids=[f"{g}-{m}-{p}" for g, m, p in TABLE])
def test_placement_boxes_match_torch(global_shape, mesh_shape, placements):
    _check_layout(global_shape, mesh_shape, placements)


def test_strided_shard_rows_are_not_contiguous():
    """FSDP2+TP on 7 rows, mesh (dp=2, tp=2): coordinate (0, 0) holds rows 0-1, (0, 1) rows 4-5."""
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    boxes = {c: placement_boxes((7, 3), (2, 2), c, placements) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    rows = {c: [(b.offsets[0], b.sizes[0]) for b, _ in bs] for c, bs in boxes.items()}
    # TP halves are rows [0, 4) and [4, 7); FSDP halves each: [0,2) [2,4) | [4,6) [6,7)
    assert rows == {(0, 0): [(0, 2)], (1, 0): [(2, 2)], (0, 1): [(4, 2)], (1, 1): [(6, 1)]}


@st.composite
def _layouts(draw):
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=mesh_ndim, max_size=mesh_ndim)))
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    placements = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["replicate", "shard", "strided"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "replicate":
            placements.append(Replicate())
        elif kind == "shard":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 3))))
    return global_shape, mesh_shape, placements


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts())
def test_placement_boxes_match_torch_random(layout):
    global_shape, mesh_shape, placements = layout
    _check_layout(global_shape, mesh_shape, placements)


def test_partial_placement_is_refused_naming_the_fqn():
    with pytest.raises(UnsupportedPlacementError, match=r"'layers\.0\.w'.*Partial"):
        placement_boxes((4, 4), (2,), (0,), [Partial()], fqn="layers.0.w")


def test_tensor_shard_views_alias_the_dtensor_local_memory():
    """A load writes through the pieces' views: they must alias ``to_local()``."""
    full = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    placements = [_StridedShard(0, split_factor=2), Shard(1)]
    with _fake_rank(2, 4):
        mesh = init_device_mesh("cpu", (2, 2))
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        shards = to_tensor_shards(dt, "w")
        assert shards.global_shape == (7, 5) and shards.dtype == torch.float32
        for box, view in shards.pieces:
            src = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
            assert torch.equal(view, full[src])
            view.fill_(-7.0)
        assert bool((dt.to_local() == -7.0).all())


def test_plain_tensor_is_one_full_piece():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    shards = to_tensor_shards(t, "x")
    assert shards.global_shape == (3, 4) and shards.dtype == torch.bfloat16
    [(box, view)] = shards.pieces
    assert box.offsets == (0, 0) and box.sizes == (3, 4)
    assert view.data_ptr() == t.data_ptr()
