"""The local save plan of DTensors (worked out once per layout) equals the plan made tensor
by tensor through ``to_tensor_shards``: same items, and views of the same memory, for
even, uneven, 2-D mesh, replicated, strided (FSDP2 + TP) and empty layouts.

Real gloo ranks (4, on a 2 x 2 mesh) so every rank's coordinate and pieces are covered.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed


def _reference(flat: dict) -> list:
    """The plan as the general path makes it: (index, sizes, shape, dtype, nbytes, view)."""
    from hyper_parallel_dcp.core.chunks import full_box
    from hyper_parallel_dcp.core.layout import to_tensor_shards
    from hyper_parallel_dcp.core.metadata import MetadataIndex, dtype_name

    out = []
    for fqn, leaf in flat.items():
        shards = to_tensor_shards(leaf, fqn)
        pieces = shards.pieces
        if math.prod(shards.global_shape) == 0:
            pieces = [(full_box(shards.global_shape), None)]
        for box, view in pieces:
            if box.is_empty() and box.volume != math.prod(shards.global_shape):
                continue
            out.append((MetadataIndex(fqn, box.offsets), box.sizes, shards.global_shape, dtype_name(shards.dtype),
                        box.volume * shards.dtype.itemsize, view))
    return out


def _views_equal(a, b) -> bool:
    if a is None or b is None:  # the empty tensor's placeholder is a new tensor
        return a is None and b.numel() == 0
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _compare(rank: int, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyper_parallel_dcp.core.save_planning import create_local_save_plan

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    layouts = {
        "even": [Shard(0), Shard(1)],
        "rows_twice": [Shard(0), Shard(0)],
        "cols": [Replicate(), Shard(1)],
        "rep": [Replicate(), Replicate()],
        "strided": [_StridedShard(0, split_factor=2), Shard(0)],
    }
    flat: dict = {}
    sources: dict = {}

    def put(fqn: str, whole: torch.Tensor, placements: list) -> None:
        sources[fqn] = whole
        flat[fqn] = distribute_tensor(whole, mesh, placements, src_data_rank=None)

    for i in range(3):  # the same layouts again: the second and third use the cached layout
        for name, placements in layouts.items():
            put(f"{name}.{i}", full + i, placements)
        # two pieces per rank, each a narrowing of the local tensor
        put(f"split.{i}", torch.arange(8 * 10.0).view(8, 10) + i, [Shard(0), _StridedShard(0, split_factor=2)])
        put(f"uneven.{i}", torch.arange(3.0) + i, [Shard(0), Shard(0)])
        put(f"empty.{i}", torch.empty(0, 4), [Shard(0), Replicate()])
        put(f"bf16.{i}", (full + i).to(torch.bfloat16), [Shard(1), Shard(0)])
    flat["plain"] = sources["plain"] = torch.ones(3, 2)
    flat["obj"] = {"lr": 0.5}
    plan, data, ragged = create_local_save_plan(flat)
    ref = _reference({k: v for k, v in flat.items() if k != "obj"})
    tensors = [it for it in plan.items if it.type.value == "tensor"]
    assert not ragged
    assert len(tensors) == len(ref), (len(tensors), len(ref))
    for item, (index, sizes, shape, dtype, nbytes, view) in zip(tensors, ref):
        assert (item.index, item.sizes, item.global_shape, item.dtype, item.nbytes) == (index, sizes, shape, dtype,
                                                                                          nbytes)
        assert _views_equal(view, data[item.index]), item.index
        got = data[item.index]
        if got.numel():  # the values are the global tensor's at the box
            box = tuple(slice(o, o + s) for o, s in zip(index.offset, sizes))
            assert torch.equal(got, sources[index.fqn][box])
    assert [it.index.fqn for it in plan.items if it.type.value == "bytes"] == ["obj"]
    assert sum(it.index.fqn == "split.2" for it in tensors) == 2
    return len(tensors)


def test_local_plan_of_dtensors_equals_the_per_tensor_path():
    counts = run_distributed(_compare, 4)
    assert all(c > 0 for c in counts)
