"""The save plan cache with real gloo ranks.

The second save of the same keys hits the cache on every rank (``planner.cache_hit`` and
the ``Hit final plan and metadata cache.`` log line), skips local/global planning, and
still writes the current values.  A rank whose keys differ makes every rank plan again
(no rank runs ahead into the write step), and a changed layout under the same keys is a
miss, not a stale plan.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

HIT = "Hit final plan and metadata cache."


def model(world_size: int, scale: float, rows: int = 8) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) * scale
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "b": torch.full((3,), scale), "step": int(scale)}


def _saves(rank: int, world_size: int, root: str) -> dict:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import StandardSavePlanner

    captured = io.StringIO()
    sys.stderr = captured  # the DCP log handler is created on first use, on this stream
    log_of: dict[str, str] = {}
    hits: dict[str, bool] = {}

    def save(name: str, sd: dict) -> None:
        start = len(captured.getvalue())
        planner = StandardSavePlanner()
        dcp.save(sd, checkpoint_id=f"{root}/{name}", planner=planner)
        hits[name] = planner.cache_hit
        log_of[name] = captured.getvalue()[start:]

    save("first", model(world_size, 1.0))
    save("second", model(world_size, 2.0))  # same keys: hit
    extra = model(world_size, 3.0)
    if rank == 1:
        extra["only_on_rank1"] = torch.ones(2)  # rank 0 would hit, rank 1 cannot
    save("keys_differ", extra)
    save("reshaped", model(world_size, 4.0, rows=12))  # same keys, other shapes: a miss
    save("reshaped_again", model(world_size, 5.0, rows=12))

    loaded = {}
    for name, scale, rows in [("first", 1.0, 8), ("second", 2.0, 8), ("keys_differ", 3.0, 8),
                              ("reshaped", 4.0, 12), ("reshaped_again", 5.0, 12)]:
        target = model(world_size, 0.0, rows)
        target["step"] = None
        dcp.load(target, checkpoint_id=f"{root}/{name}")
        expected = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) * scale
        loaded[name] = bool(torch.equal(target["w"].full_tensor(), expected)
                            and torch.equal(target["b"], torch.full((3,), scale)) and target["step"] == int(scale))
    sys.stderr = sys.__stderr__
    return {"hits": hits, "logs": log_of, "loaded": loaded}


def test_second_save_hits_the_cache_on_every_rank(tmp_path):
    results = run_distributed(_saves, 2, str(tmp_path), timeout=240, env={"HP_LOG_CONFIG": "DCP:INFO"})
    for rank, result in enumerate(results):
        assert result["hits"] == {"first": False, "second": True, "keys_differ": False,
                                  "reshaped": False, "reshaped_again": True}, f"rank {rank}"
        assert all(result["loaded"].values()), (rank, result["loaded"])
        logs = result["logs"]
        assert f"[rank={rank}] {HIT}" in logs["second"] and HIT not in logs["first"]
        # a hit skips local plan, gather and global plan
        assert "build_local_plan" in logs["first"]
        assert ("build_global_plan" in logs["first"]) == (rank == 0)  # the coordinator plans globally
        for phase in ("build_local_plan", "build_global_plan", "scatter_object"):  # results are still gathered
            assert f"func {phase} cost" not in logs["second"], (rank, phase, logs["second"])
        assert "func execute_write cost" in logs["second"]
        # planned again on every rank, also on rank 0 whose own keys were cached
        assert "func build_local_plan cost" in logs["keys_differ"] and HIT not in logs["keys_differ"]
        assert "func build_local_plan cost" in logs["reshaped"] and HIT not in logs["reshaped"]
