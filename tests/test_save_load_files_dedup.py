"""What a save leaves on disk, with real gloo ranks: dedup, per-rank files, crashes.

- replicated tensors are stored once, by owners balanced by bytes (or the lowest rank with
  ``save_to_minimum_rank``), in safetensors files the ``safetensors`` library reads as is;
- ``use_collectives=False`` writes ``{rank}.metadata`` files, and a load on another world
  size falls back to them;
- a save whose coordinator is SIGKILLed during ``execute_write`` leaves no ``.metadata``,
  and the earlier checkpoint in the same directory still loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import DistributedTestError, run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemWriter

pytestmark = pytest.mark.distributed

# replicated plain tensors of very different sizes (float32 elements)
REPLICATED = {f"rep{i}": n for i, n in enumerate([1000, 700, 500, 300, 200, 100, 50, 25, 10])}
SHARD_ROWS = 40  # "sh" is (40, 8), Shard(0): 10 rows = 320 bytes per rank on 4 ranks


def replicated_value(name: str) -> torch.Tensor:
    return torch.arange(REPLICATED[name], dtype=torch.float32) + 1000.0 * int(name[3:])


def sharded_value() -> torch.Tensor:
    return torch.arange(SHARD_ROWS * 8, dtype=torch.float32).view(SHARD_ROWS, 8) * 0.5


def model_state(world_size: int, *, empty: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd: dict = {name: replicated_value(name) for name in REPLICATED}
    sd["sh"] = distribute_tensor(sharded_value(), mesh, [Shard(0)], src_data_rank=None)
    sd["rdt"] = distribute_tensor(torch.linspace(0, 1, 64), mesh, [Replicate()], src_data_rank=None)
    sd["step"] = 5
    if empty:  # same layout, other values: what a load must overwrite
        for name in REPLICATED:
            sd[name].zero_()
        sd["sh"].to_local().zero_()
        sd["rdt"].to_local().zero_()
        sd["step"] = None
    return sd


def check_model_state(sd: dict) -> None:
    for name in REPLICATED:
        assert torch.equal(sd[name], replicated_value(name)), name
    assert torch.equal(sd["sh"].full_tensor(), sharded_value())
    assert torch.equal(sd["rdt"].full_tensor(), torch.linspace(0, 1, 64))
    assert sd["step"] == 5


def summary(md) -> dict:
    """Plain-data view of a returned Metadata: chunks per FQN and the file of each chunk."""
    return {
        "chunks": {fqn: [(list(c.offsets), list(c.sizes)) for c in m.chunks]
                   for fqn, m in md.state_dict_metadata.items() if hasattr(m, "chunks")},
        "where": sorted((idx.fqn, list(idx.offset or ()), info.relative_path, info.length)
                        for idx, info in md.storage_data.items()),
    }


def _save_on_four(rank: int, world_size: int, root: str) -> dict:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import StandardSavePlanner

    sd = model_state(world_size)
    balanced = dcp.save(sd, checkpoint_id=f"{root}/balanced")
    minimum = dcp.save(sd, checkpoint_id=f"{root}/minimum",
                       planner=StandardSavePlanner(save_to_minimum_rank=True))
    local = dcp.save(sd, checkpoint_id=f"{root}/local", use_collectives=False)
    return {"balanced": summary(balanced), "minimum": summary(minimum), "local": summary(local)}


def _load_fallback_on_two(rank: int, world_size: int, root: str) -> None:
    import hyper_parallel_dcp as dcp

    for name in ["local", "balanced"]:
        target = model_state(world_size, empty=True)
        dcp.load(target, checkpoint_id=f"{root}/{name}")
        check_model_state(target)
    # 2 ranks save without collectives over the 4-rank per-rank checkpoint: the result
    # must be the new checkpoint, not a mix with the old ranks 2 and 3
    newer = model_state(world_size)
    newer["sh"].to_local().mul_(-1.0)
    dcp.save(newer, checkpoint_id=f"{root}/local_again", use_collectives=False)
    # A save without collectives does not wait for the other ranks: without this barrier
    # rank 0 may read (and share) the metadata before rank 1 has written its own.
    torch.distributed.barrier()
    target = model_state(world_size, empty=True)
    dcp.load(target, checkpoint_id=f"{root}/local_again")
    assert torch.equal(target["sh"].full_tensor(), -sharded_value()), "old per-rank chunks leaked into the load"


def _rank_of(file: str) -> int:
    return int(re.fullmatch(r"_rank(\d+)_\.(safetensors|bytes)", file).group(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("files"))
    results = run_distributed(_save_on_four, 4, root, timeout=240)
    return root, results


def test_replicated_tensors_are_stored_once_by_byte_balanced_owners(saved):
    root, results = saved
    balanced = results[0]["balanced"]
    assert all(r["balanced"] == balanced for r in results)  # the same global metadata everywhere
    for name, n in REPLICATED.items():
        assert balanced["chunks"][name] == [([0], [n])]
    assert balanced["chunks"]["rdt"] == [([0], [64])]
    assert balanced["chunks"]["sh"] == [([r * 10, 0], [10, 8]) for r in range(4)]
    owner = {fqn: _rank_of(file) for fqn, _, file, _ in balanced["where"]}
    assert [_rank_of(file) for fqn, _, file, _ in balanced["where"] if fqn == "sh"] == [0, 1, 2, 3]
    # reference: largest replicated chunk first, to the rank with the fewest bytes so far
    planned = [320] * 4
    items = sorted([(-4 * n, name) for name, n in REPLICATED.items()] + [(-4 * 64, "rdt")])
    for neg, name in items:
        rank = min(range(4), key=lambda r: (planned[r], r))
        assert owner[name] == rank, f"{name}: owner {owner[name]}, expected {rank}"
        planned[rank] -= neg
    written = [0] * 4
    for _, _, file, length in balanced["where"]:
        if file.endswith(".safetensors"):
            written[_rank_of(file)] += length
    assert written == planned
    assert max(written) - min(written) <= 4 * max(REPLICATED.values())

    minimum = results[0]["minimum"]
    assert {fqn: _rank_of(file) for fqn, _, file, _ in minimum["where"] if fqn != "sh"} == \
        {**{name: 0 for name in REPLICATED}, "rdt": 0, "step": 0}


def test_shard_files_are_plain_safetensors_in_global_order(saved):
    from safetensors import safe_open

    root, results = saved
    seen = {}
    for file in sorted(Path(root, "balanced").glob("_rank*_.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                seen[key] = f.get_tensor(key)
        raw = file.read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        keys = [k for k in header if k != "__metadata__"]
        by_offset = sorted(keys, key=lambda k: header[k]["data_offsets"][0])
        assert by_offset == sorted(keys), f"{file.name}: chunks not laid out in key order"
    expected = {name: replicated_value(name) for name in REPLICATED}
    expected["rdt"] = torch.linspace(0, 1, 64)
    for fqn, value in expected.items():
        [key] = [k for k in seen if k.rsplit(" ", 1)[0] == fqn]
        assert torch.equal(seen[key], value), fqn
    shards = sorted((k, v) for k, v in seen.items() if k.rsplit(" ", 1)[0] == "sh")
    assert torch.equal(torch.cat([v for _, v in shards]), sharded_value())


def test_no_collectives_writes_rank_metadata_and_loads_on_another_world_size(saved):
    import hyper_parallel_dcp as dcp

    root, results = saved
    names = sorted(os.listdir(f"{root}/local"))
    assert ".metadata" not in names
    assert {"0.metadata", "1.metadata", "2.metadata", "3.metadata"} <= set(names)
    for rank, result in enumerate(results):
        local = result["local"]
        # no dedup without collectives: each rank's own metadata lists its own chunks
        assert local["chunks"]["sh"] == [([rank * 10, 0], [10, 8])]
        assert {_rank_of(file) for _, _, file, _ in local["where"]} == {rank}
    shutil.copytree(f"{root}/local", f"{root}/local_again")
    run_distributed(_load_fallback_on_two, 2, root, timeout=240)
    single = {name: torch.zeros(n) for name, n in REPLICATED.items()} | {"sh": torch.zeros(SHARD_ROWS, 8)}
    dcp.load(single, checkpoint_id=f"{root}/local", no_dist=True)
    assert torch.equal(single["sh"], sharded_value()) and torch.equal(single["rep3"], replicated_value("rep3"))


class KilledWriter(FileSystemWriter):
    """Writes this rank's files, then the coordinator dies before anything is committed."""

    def execute_write(self, plan, planner):
        results = super().execute_write(plan, planner)
        if self.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return results


def _killed_save(rank: int, world_size: int, path: str) -> None:
    import hyper_parallel_dcp as dcp

    dcp.save({"w": torch.full((6, 4), 2.0), "extra": torch.ones(3)}, storage_writer=KilledWriter(path))


def test_save_killed_during_write_leaves_the_earlier_checkpoint_loadable(tmp_path):
    import hyper_parallel_dcp as dcp

    target = tmp_path / "ckpt"
    dcp.save({"w": torch.full((6, 4), 1.0)}, checkpoint_id=target, no_dist=True)
    before = (target / ".metadata").read_bytes()
    with pytest.raises(DistributedTestError, match=r"rank 0 failed:\nprocess exited with code -9"):
        run_distributed(_killed_save, 2, str(target), timeout=120)
    # the crashed save left its files somewhere, but no .metadata anywhere
    metadata_files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*metadata"))
    assert metadata_files == ["ckpt/.metadata"], metadata_files
    assert (target / ".metadata").read_bytes() == before
    loaded = {"w": torch.zeros(6, 4)}
    dcp.load(loaded, checkpoint_id=target, no_dist=True)
    assert torch.equal(loaded["w"], torch.full((6, 4), 1.0))
    # the dead save holds no lock: the next save goes through and replaces the checkpoint
    dcp.save({"w": torch.full((6, 4), 3.0)}, checkpoint_id=target, no_dist=True)
    dcp.load(loaded, checkpoint_id=target, no_dist=True)
    assert torch.equal(loaded["w"], torch.full((6, 4), 3.0))
