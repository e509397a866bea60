"""SPEC §13, the node-local tier with peer replicas, with real processes: 4 gloo ranks as 2
"nodes" (``LocalTier(node=...)``, a directory per node).  A lost node restores from the
replicas bit-exact with no byte from the persistent tier; both copies of a rank lost, a
corrupt copy, a rank killed mid local save and a full local disk each fall back as promised."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import FileReads, run_console_script, run_distributed

pytestmark = pytest.mark.distributed

TIMEOUTS = {"HP_DCP_COLLECTIVE_TIMEOUT": "10"}


@functools.cache
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (4,))


def _sharded(full: torch.Tensor) -> torch.Tensor:
    """``full`` as a DTensor sharded by rows over the 4 ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    rows = full.shape[0] // 4  # this rank's rows, without a collective
    return DTensor.from_local(full[dist.get_rank() * rows:][:rows].clone(), _mesh(), [Shard(0)], run_check=False)


def _state(step: int, rank: int, sharded: bool = False) -> dict:
    """Replicated, rank-own and (``sharded``: DTensor's first use costs seconds a process) sharded leaves."""
    sd = {"w": torch.full((64, 4), float(step)), f"own{rank}": torch.arange(1000.0) + 100 * step + rank,
          "train": {"step": step}}
    return {**sd, "sharded": _sharded(torch.arange(256.0).reshape(32, 8) * step)} if sharded else sd


def _zeros(rank: int, sharded: bool = False) -> dict:
    sd = {"w": torch.zeros(64, 4), f"own{rank}": torch.zeros(1000), "train": {"step": -1}}
    return {**sd, "sharded": _sharded(torch.zeros(32, 8))} if sharded else sd


def _manager(root: str, rank: int, per_node: int = 2, **kw):
    from hyper_parallel_dcp import CheckpointManager, LocalTier

    tier = LocalTier(f"{root}/node{rank // per_node}", interval_steps=1, keep_last=2, node=rank // per_node)
    return CheckpointManager(f"{root}/persist", save_interval_steps=3, local=tier, **kw), tier


def _save_worker(rank: int, world_size: int, root: str, last: int, fault: str = "", at: int = 0,
                 sharded: bool = False) -> dict:
    mgr, tier = _manager(root, rank)
    for step in range(1, last + 1):
        if step == at:
            tier.wait()  # the fault is for step `at`, not for the previous step's local save still in flight
            os.environ["HP_DCP_FAULT"] = fault
        mgr.save(step, _state(step, rank, sharded))
    mgr.close()
    return {"error": None if tier.last_error is None else str(tier.last_error), **tier.stats}


class _Lines(list):
    def write(self, text: str) -> None:
        self.append(text)

    def flush(self) -> None:
        pass


def _restore_worker(rank: int, world_size: int, root: str, sharded: bool = False) -> dict:
    import logging

    lines = _Lines()
    handler = logging.StreamHandler(lines)
    logging.getLogger("hyper_parallel_dcp").addHandler(handler)
    logging.getLogger("hyper_parallel_dcp").setLevel(logging.INFO)
    mgr, tier = _manager(root, rank)
    target = _zeros(rank, sharded)
    with FileReads() as reads:
        step = mgr.restore(target)
    persist = os.path.realpath(f"{root}/persist")
    expected = _state(step, rank, sharded) if step is not None else _zeros(rank, sharded)
    exact = all(torch.equal(target[k], expected[k]) for k in ("w", f"own{rank}")) and target["train"] == expected[
        "train"] and (not sharded or torch.equal(target["sharded"].to_local(), expected["sharded"].to_local()))
    mgr.close()
    return {"step": step, "exact": exact, "log": "".join(lines), "persistent_bytes": reads.bytes_from(
        lambda path, _: os.path.realpath(path).startswith(persist)), **tier.stats}


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Steps 1-5 in the local tier (steps 4 and 5 kept), steps 3 in the persistent one."""
    root = tmp_path_factory.mktemp("saved")
    return root, run_distributed(_save_worker, 4, str(root), 5, timeout=120, env=TIMEOUTS)


def _copy(five_steps: tuple[Path, list[dict]], tmp_path: Path) -> Path:
    shutil.copytree(five_steps[0], tmp_path / "job")
    return tmp_path / "job"


def test_lost_node_restores_from_replicas_bit_exact_without_reading_the_persistent_tier(
        five_steps: tuple[Path, list[dict]], tmp_path: Path) -> None:
    saved, tmp_path = five_steps[1], _copy(five_steps, tmp_path)
    assert [s["error"] for s in saved] == [None] * 4
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["step_4", "step_5"]  # keep_last=2
    # node 0 holds ranks 0, 1 and the replicas of ranks 2, 3 (same local rank, other node)
    assert sorted(p.name for p in (tmp_path / "node0/step_5").iterdir()) == sorted(
        [f"rank_{r}" for r in range(4)] + [f"rank_{r}.commit" for r in range(4)])
    assert all(s["replica_bytes"] > s["bytes"] for s in saved)  # files: the tensors and their headers
    out = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "ls", str(tmp_path / "persist"), "--local",
                             str(tmp_path / "node0"), "--json")
    listed = json.loads(out.stdout)
    assert out.returncode == 0 and listed["latest"] == 3
    assert [(r["step"], r["ranks"]) for r in listed["local"][str(tmp_path / "node0")]] == [(4, [0, 1, 2, 3]),
                                                                                          (5, [0, 1, 2, 3])]
    shutil.rmtree(tmp_path / "node1")  # the node is lost with its local disk
    restored = run_distributed(_restore_worker, 4, str(tmp_path), timeout=120, env=TIMEOUTS)
    assert [r["step"] for r in restored] == [5] * 4  # local step 5 is newer than persistent step 3
    assert all(r["exact"] for r in restored)
    assert [r["persistent_bytes"] for r in restored] == [0] * 4
    assert [r["received_bytes"] > 0 for r in restored] == [False, False, True, True]
    # the fetched copies are node 1's own again: a second loss of node 0 now restores too
    shutil.rmtree(tmp_path / "node0")
    again = run_distributed(_restore_worker, 4, str(tmp_path), timeout=120, env=TIMEOUTS)
    assert [r["step"] for r in again] == [3] * 4 and all(r["exact"] for r in again)


def test_both_copies_of_one_rank_lost_restores_from_the_persistent_tier(
        five_steps: tuple[Path, list[dict]], tmp_path: Path) -> None:
    root = _copy(five_steps, tmp_path)
    for copy in root.glob("node*/step_*/rank_2*"):
        shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
    restored = run_distributed(_restore_worker, 4, str(root), timeout=120, env=TIMEOUTS)
    assert [r["step"] for r in restored] == [3] * 4 and all(r["exact"] for r in restored)
    assert all(r["persistent_bytes"] > 0 for r in restored)
    assert "step 5 is not complete: no copy of rank(s) [2] is left" in restored[0]["log"]
    assert not list(root.glob("node*/step_*/*"))  # the newer local steps of the abandoned run are gone


def test_a_corrupt_local_copy_is_replaced_by_its_replica_and_logged(
        five_steps: tuple[Path, list[dict]], tmp_path: Path) -> None:
    root = _copy(five_steps, tmp_path)
    data = root / "node0/step_5/rank_0/_rank0_.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # in rank 0's own tensor: the checksum fails, the size does not change
    data.write_bytes(bytes(raw))
    # and a partial copy (shorter than its marker says): not even a candidate
    (root / "node1/step_5/rank_3/_rank0_.safetensors").write_bytes(b"short")
    restored = run_distributed(_restore_worker, 4, str(root), timeout=120, env=TIMEOUTS)
    assert [r["step"] for r in restored] == [5] * 4 and all(r["exact"] for r in restored)
    assert [r["persistent_bytes"] for r in restored] == [0] * 4
    assert "rank 0's copy of step 5 (from rank 0) is not usable: CorruptCheckpointError" in restored[0]["log"]
    assert "trying the replica on rank 2" in restored[0]["log"]
    assert restored[0]["received_bytes"] > 0 and data.read_bytes() != bytes(raw)  # the replica's bytes now
    assert "_rank0_.safetensors has 5 bytes" in restored[3]["log"] and restored[3]["received_bytes"] > 0
    assert [r["received_bytes"] > 0 for r in restored] == [True, False, False, True]


def test_a_rank_killed_mid_local_save_leaves_that_step_never_loaded(tmp_path: Path) -> None:
    from hyper_parallel_dcp.core.testing import run_ranks

    out = run_ranks(_save_worker, 4, str(tmp_path), 4, "local.replicate@1", 4, True, timeout=180,
                    env={"HP_DCP_COLLECTIVE_TIMEOUT": "4"})
    assert out[1][0] == "died" and all(out[r][0] == "ok" for r in (0, 2, 3)), out
    assert all(out[r][1]["error"] for r in (0, 2, 3))  # their wait for rank 1 timed out: logged, not raised
    assert not list(tmp_path.glob("node*/step_4/*.commit"))  # nothing of step 4 committed
    restored = run_distributed(_restore_worker, 4, str(tmp_path), True, timeout=180, env=TIMEOUTS)
    assert [r["step"] for r in restored] == [3] * 4 and all(r["exact"] for r in restored)  # DTensor shards too
    assert [r["persistent_bytes"] for r in restored] == [0] * 4  # local step 3 is as new as the persistent one


def test_a_full_local_disk_is_an_error_naming_dir_and_bytes_and_the_persistent_save_happens(tmp_path: Path) -> None:
    saved = run_distributed(_save_worker, 4, str(tmp_path), 3, "local.full@1", 1, timeout=120, env=TIMEOUTS)
    error = saved[1]["error"]
    assert f"{tmp_path}/node0 has no room for rank 1's copy of step 3: {saved[1]['bytes']} bytes needed" in error
    assert "the persistent tier is not affected" in error
    assert all("local step 3 not committed: rank 1 failed: LocalTierFullError" in saved[r]["error"] for r in (0, 2, 3))
    assert (tmp_path / "persist/step_3/.metadata").is_file()
    assert not list(tmp_path.glob("node*/step_*/*.commit"))
    restored = run_distributed(_restore_worker, 4, str(tmp_path), timeout=120, env=TIMEOUTS)
    assert [r["step"] for r in restored] == [3] * 4 and all(r["exact"] for r in restored)
    assert all(r["persistent_bytes"] > 0 for r in restored)


def test_one_process_without_a_process_group(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hyper_parallel_dcp import CheckpointManager, LocalTier

    with CheckpointManager(tmp_path / "persist", save_interval_steps=2,
                           local=LocalTier(tmp_path / "local", interval_steps=1, keep_last=1)) as mgr:
        assert [mgr.save(step, _state(step, 0)) for step in (1, 2, 3)] == [True] * 3
    assert mgr.all_steps() == [2] and sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step_3"]
    target = _zeros(0)
    with CheckpointManager(tmp_path / "persist", local=LocalTier(tmp_path / "local", interval_steps=1)) as mgr:
        assert mgr.restore(target) == 3
    assert torch.equal(target["own0"], _state(3, 0)["own0"]) and target["train"] == {"step": 3}
    with pytest.raises(ValueError, match=r"LocalTier\(replicas=...\) must be an integer >= 0, got -1"):
        LocalTier(tmp_path, interval_steps=1, replicas=-1)


@functools.cache
def _world_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _layout_state(step: int, rank: int, world: int, dim: int) -> dict:
    """What any world size saves and loads alike: a replicated tensor, an object and a
    DTensor sharded on ``dim`` over the ``world`` ranks."""
    from torch.distributed.tensor import DTensor, Shard

    full = torch.arange(256.0).reshape(32, 8) * step
    n = full.shape[dim] // world
    local = full.narrow(dim, rank * n, n).clone()
    return {"w": torch.full((64, 4), float(step)), "train": {"step": step},
            "sharded": DTensor.from_local(local, _world_mesh(world), [Shard(dim)], run_check=False)}


def _layout_save(rank: int, world_size: int, root: str, last: int) -> dict:
    mgr, tier = _manager(root, rank, per_node=world_size // 2)
    for step in range(1, last + 1):
        mgr.save(step, _layout_state(step, rank, world_size, 0))
    mgr.close()
    return {"error": None if tier.last_error is None else str(tier.last_error)}


def _layout_restore(rank: int, world_size: int, root: str, per_node: int, dim: int) -> dict:
    import logging

    lines = _Lines()
    logging.getLogger("hyper_parallel_dcp").addHandler(logging.StreamHandler(lines))
    logging.getLogger("hyper_parallel_dcp").setLevel(logging.INFO)
    mgr, tier = _manager(root, rank, per_node=per_node)
    target = _layout_state(0, rank, world_size, dim)
    with FileReads() as reads:
        step = mgr.restore(target)
    expected = _layout_state(step, rank, world_size, dim)
    exact = torch.equal(target["w"], expected["w"]) and target["train"] == expected["train"] and torch.equal(
        target["sharded"].to_local(), expected["sharded"].to_local())
    mgr.close()
    persist = os.path.realpath(f"{root}/persist")
    return {"step": step, "exact": exact, "log": "".join(lines), "persistent_bytes": reads.bytes_from(
        lambda path, _: os.path.realpath(path).startswith(persist)), **tier.stats}


@pytest.mark.parametrize("saved, restored, per_node, dim", [(4, 2, 1, 0), (2, 4, 2, 1)])
def test_another_world_size_restores_from_the_local_tier_bit_exact(tmp_path: Path, saved: int, restored: int,
                                                                   per_node: int, dim: int) -> None:
    """4 ranks as 2 nodes → 2 ranks (one a node: rank 1 holds old ranks 3's copy and 1's
    replica), and 2 → 4 with the DTensor sharded on another dim: local step 4 (newer than
    persistent step 3) from the copies the new ranks hold, none read from the persistent tier."""
    assert [s["error"] for s in run_distributed(_layout_save, saved, str(tmp_path), 4, timeout=180,
                                                env=TIMEOUTS)] == [None] * saved
    out = run_distributed(_layout_restore, restored, str(tmp_path), per_node, dim, timeout=180, env=TIMEOUTS)
    assert [r["step"] for r in out] == [4] * restored and all(r["exact"] for r in out)
    assert [r["persistent_bytes"] for r in out] == [0] * restored
    assert [r["saved_world_size"] for r in out] == [saved] * restored
    assert all(r["received_bytes"] > 0 for r in out[1:])  # their shards' rows were saved on other ranks
    assert f"restored step 4, saved by {saved} ranks" in out[0]["log"]
    assert not list(tmp_path.glob("node*/.restore/*"))  # the received copies are gone once loaded
    if saved == 4:  # node 1's disk lost: old ranks 1 and 3 have no copy on the 2 ranks → persistent tier
        shutil.rmtree(tmp_path / "node1")
        out = run_distributed(_layout_restore, 2, str(tmp_path), 1, 0, timeout=180, env=TIMEOUTS)
        assert [r["step"] for r in out] == [3, 3] and all(r["exact"] for r in out)
        assert all(r["persistent_bytes"] > 0 for r in out)
        assert ("step 4 is not complete: no copy of rank(s) [1, 3] is left on the 2 rank(s) of this job (saved by 4 "
                "ranks)") in out[0]["log"]
