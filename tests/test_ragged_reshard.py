"""Ragged (flat-range / uneven-row) shards saved and loaded across layouts, real gloo ranks."""

from __future__ import annotations

import math
import os

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

SHAPES = {"w": (10, 7), "t3": (4, 3, 5), "bias": (9,)}


def reference(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*SHAPES[name], generator=gen)


def split_points(total: int, world_size: int, skew: int) -> list[tuple[int, int]]:
    """Deliberately uneven contiguous ranges covering [0, total)."""
    cuts = sorted({min(total, max(0, (total * (r + 1)) // world_size + skew * (r % 2 * 2 - 1))) for r in range(world_size - 1)})
    points = [0, *cuts, total]
    return [(points[i], points[i + 1]) for i in range(world_size)]


def ragged_of(name: str, ranges: list[tuple[int, int]], fill: float | None = None):
    from hyper_parallel_dcp import RaggedShard

    flat = reference(name).reshape(-1)
    local = torch.cat([flat[s:e] for s, e in ranges]) if ranges else torch.empty(0)
    if fill is not None:
        local = torch.full_like(local, fill)
    return RaggedShard(local, SHAPES[name], ranges)


def zero_ranges(rank: int, world_size: int, name: str) -> list[tuple[int, int]]:
    """ZeRO-style flat partition in world_size + 1 parts; rank 0 holds two separate ranges."""
    total = math.prod(SHAPES[name])
    parts = split_points(total, world_size + 1, skew=3)
    mine = {0: [parts[0], parts[2]], 1: [parts[1]]}.get(rank, [parts[rank + 1]])
    return [r for r in mine if r[1] > r[0]]


def _save_zero(rank: int, world_size: int, path: str, cache_path: str) -> list[bool]:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner

    sd = {name: ragged_of(name, zero_ranges(rank, world_size, name)) for name in SHAPES}
    dcp.save(sd, checkpoint_id=path)
    hits = []
    for _ in range(2):  # a ragged leaf turns the plan cache off
        planner = StandardSavePlanner()
        dcp.save(sd, checkpoint_id=cache_path, planner=planner)
        hits.append(planner.cache_hit)
    dense = {"d": torch.ones(4)}  # control: without ragged leaves the cache is hit
    for _ in range(2):
        planner = StandardSavePlanner()
        dcp.save(dense, checkpoint_id=cache_path + "-dense", planner=planner)
        hits.append(planner.cache_hit)
    return hits


def _save_rows_and_optim(rank: int, world_size: int, rows_path: str, optim_path: str) -> None:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import RaggedShard

    row_cuts = [(0, 1), (1, 5), (5, 6), (6, 10)]  # uneven rows over 4 ranks
    start, end = row_cuts[rank]
    rows = reference("w")[start:end].contiguous()
    dcp.save({"w": RaggedShard.from_rows(rows, SHAPES["w"], start)}, checkpoint_id=rows_path)

    optim = {"state": {}, "param_groups": [{"lr": 0.01, "params": [0, 1]}]}
    for name in ("w", "t3"):
        total = math.prod(SHAPES[name])
        ranges = [split_points(total, world_size, skew=2)[rank]]
        optim["state"][name] = {
            "exp_avg": ragged_of(name, ranges),
            "exp_avg_sq": RaggedShard(ragged_of(name, ranges).local_tensor ** 2, SHAPES[name], ranges),
            "step": torch.tensor(12.0),
        }
    dcp.save({"optim": optim}, checkpoint_id=optim_path)


def _load_dtensors(rank: int, world_size: int, zero_path: str, rows_path: str, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    target = {name: distribute_tensor(torch.zeros(SHAPES[name]), mesh, [Shard(len(SHAPES[name]) - 1)]) for name in SHAPES}
    dcp.load(target, checkpoint_id=zero_path)
    for name in SHAPES:
        assert torch.equal(target[name].full_tensor(), reference(name)), name
    even = {"w": distribute_tensor(torch.zeros(SHAPES["w"]), mesh, [Shard(0)])}
    dcp.load(even, checkpoint_id=rows_path)
    assert torch.equal(even["w"].full_tensor(), reference("w"))
    dcp.save(target, checkpoint_id=out_path)  # DTensor Shard(last dim) → for the ragged load back


def _load_ragged(rank: int, world_size: int, dtensor_path: str, optim_path: str) -> dict[str, int]:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import FileSystemReader, RaggedShard

    stats = {}
    for name in ("w", "t3"):
        total = math.prod(SHAPES[name])
        ranges = [split_points(total, world_size, skew=1)[rank]]
        shard = ragged_of(name, ranges, fill=0.0)
        reader = FileSystemReader(dtensor_path)
        dcp.load({name: shard}, storage_reader=reader, broadcast_replicated_tensors=False)
        flat = reference(name).reshape(-1)
        expected = torch.cat([flat[s:e] for s, e in ranges])
        assert torch.equal(shard.local_tensor, expected), (name, ranges)
        row_bytes = math.prod(SHAPES[name][1:]) * 4
        stats[name] = reader.bytes_read - shard.local_tensor.numel() * 4
        assert reader.bytes_read <= shard.local_tensor.numel() * 4 + 2 * row_bytes, (name, reader.bytes_read)

    optim = {"state": {}, "param_groups": [{"lr": 0.0, "params": []}]}
    for name in ("w", "t3"):
        total = math.prod(SHAPES[name])
        ranges = [split_points(total, world_size, skew=-1)[rank]]
        size = ranges[0][1] - ranges[0][0]
        optim["state"][name] = {
            "exp_avg": RaggedShard(torch.zeros(size), SHAPES[name], ranges),
            "exp_avg_sq": RaggedShard(torch.zeros(size), SHAPES[name], ranges),
            "step": torch.tensor(0.0),
        }
    dcp.load({"optim": optim}, checkpoint_id=optim_path)
    for name in ("w", "t3"):
        (start, end), = optim["state"][name]["exp_avg"].flat_ranges
        flat = reference(name).reshape(-1)[start:end]
        assert torch.equal(optim["state"][name]["exp_avg"].local_tensor, flat)
        assert torch.equal(optim["state"][name]["exp_avg_sq"].local_tensor, flat ** 2)
        assert float(optim["state"][name]["step"]) == 12.0
    assert optim["param_groups"] == [{"lr": 0.01, "params": [0, 1]}]
    return stats


def test_ragged_layouts_round_trip_through_dtensor_layouts(tmp_path):
    zero_path, cache_path = str(tmp_path / "zero3"), str(tmp_path / "cache")
    rows_path, optim_path = str(tmp_path / "rows4"), str(tmp_path / "optim4")
    dtensor_path = str(tmp_path / "dtensor2")

    hits = run_distributed(_save_zero, 3, zero_path, cache_path, timeout=240)
    assert all(h == [False, False, False, True] for h in hits), hits
    run_distributed(_save_rows_and_optim, 4, rows_path, optim_path, timeout=240)
    assert os.path.exists(os.path.join(rows_path, ".metadata"))
    run_distributed(_load_dtensors, 2, zero_path, rows_path, dtensor_path, timeout=240)
    run_distributed(_load_ragged, 3, dtensor_path, optim_path, timeout=240)


def test_zero_ranges_partition_every_tensor():
    for name in SHAPES:
        total = math.prod(SHAPES[name])
        for world in (3, 4):
            covered = sorted(r for rank in range(world) for r in zero_ranges(rank, world, name))
            flat = [i for s, e in covered for i in range(s, e)]
            assert flat == list(range(total)), (name, world, covered)
