"""The plan step of a save answers every rank with its final plan and a save id: a rank whose
plan the global step kept gets back the items it sent, a rank that lost items (dedup) the
cut of them; both load back exactly.

Real gloo ranks; the plan each rank sends to the coordinator's gather and the one it receives
from its scatter are recorded by wrapping ``DistWrapper.gather_object`` and
``DistWrapper.scatter_object`` (the collectives themselves run unchanged).
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.arange(seed, seed + torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def _state(world_size: int, replicated: bool, *, empty: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd: dict = {f"layer{i}.w": distribute_tensor(_values((8, 4), 100 * i), mesh, [Shard(0)], src_data_rank=None)
                for i in range(6)}
    if replicated:  # held whole by every rank: dedup keeps it on one of them
        sd["norm"] = _values((16,), 7)
    if empty:
        for value in sd.values():
            (value.to_local() if hasattr(value, "to_local") else value).zero_()
    return sd


def _save_and_load(rank: int, world_size: int, path: str, replicated: bool) -> dict:
    from torch.distributed.tensor import DTensor

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.core import collectives
    from hyper_parallel_dcp.core.planner import SavePlan
    from hyper_parallel_dcp.core.save_planning import StandardSavePlanner

    sent: list[SavePlan] = []
    received: list[str] = []
    original_gather, original_scatter = collectives.DistWrapper.gather_object, collectives.DistWrapper.scatter_object

    def sending(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, SavePlan):
            sent.append(obj)
        return original_gather(self, obj)

    def recording(self, objs):  # type: ignore[no-untyped-def]
        out = original_scatter(self, objs)
        _tag, value = out
        assert isinstance(value, SavePlan) and value.save_id is not None, value
        received.append("kept" if tuple(value.items) == tuple(sent[-1].items) else "cut")
        return out

    collectives.DistWrapper.gather_object = sending  # type: ignore[method-assign]
    collectives.DistWrapper.scatter_object = recording  # type: ignore[method-assign]
    try:
        StandardSavePlanner.clear_cache()
        metadata = hp.save(_state(world_size, replicated), checkpoint_id=path)
    finally:
        collectives.DistWrapper.gather_object = original_gather  # type: ignore[method-assign]
        collectives.DistWrapper.scatter_object = original_scatter  # type: ignore[method-assign]
    target = _state(world_size, replicated, empty=True)
    hp.load(target, checkpoint_id=path)
    reference = _state(world_size, replicated)
    equal = all(
        torch.equal(target[k].full_tensor() if isinstance(target[k], DTensor) else target[k],
                    reference[k].full_tensor() if isinstance(reference[k], DTensor) else reference[k])
        for k in reference
    )
    return {"received": received, "equal": equal, "keys": sorted(metadata.state_dict_metadata)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_only_plans_come_back_as_sent(tmp_path, world_size: int) -> None:
    results = run_distributed(_save_and_load, world_size, str(tmp_path / "ck"), False, timeout=180)
    for rank, out in enumerate(results):
        assert out["received"] == ["kept"], (rank, out)
        assert out["equal"], rank
        assert out["keys"] == sorted(f"layer{i}.w" for i in range(6))


def test_a_rank_that_loses_items_gets_its_whole_plan(tmp_path) -> None:
    results = run_distributed(_save_and_load, 2, str(tmp_path / "ck"), True, timeout=180)
    # "norm" (64 bytes) is kept by exactly one rank: the other one's plan shrank
    assert sorted(out["received"][0] for out in results) == ["cut", "kept"], results
    assert all(out["equal"] for out in results)
