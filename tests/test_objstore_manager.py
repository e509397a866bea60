"""CheckpointManager and the hp-dcp root tools on an ``s3://`` root (moto's S3 server on 127.0.0.1).

A training loop with retention (keep_last / keep_every), leftovers of dead saves (an
incomplete step and its stale lock) removed by retention, restore of the newest and of a
chosen step, ``hp-dcp ls / clean / diff / explain`` on bucket URLs, and async saves on two
real gloo ranks.  Values are compared with reference tensors built independently.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_distributed
from hyper_parallel_dcp.storage_object import ObjectStore
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)

#: A killed save's lock object is taken over / removed this many seconds after its last renewal.
STALE_AFTER = "2"


def _full(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).bfloat16()},
            "train": {"step": step}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "train": {"step": -1}}


def _equal(sd: dict, step: int) -> bool:
    want = _full(step)
    return (torch.equal(sd["model"]["w"], want["model"]["w"]) and torch.equal(sd["model"]["b"], want["model"]["b"])
            and sd["train"] == want["train"])


def _keys(prefix: str) -> list[str]:
    return sorted(k for k, size in ObjectStore(TEST_BUCKET).list_objects(prefix) if size >= 0)


def test_manager_loop_retention_leftovers_restore_and_tools_on_s3(s3_test_env, monkeypatch, capsys, tmp_path):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import CheckpointManager
    from hyper_parallel_dcp.cli import main as hp_dcp
    from hyper_parallel_dcp.step_storage import step_storage_for

    monkeypatch.setenv("HP_DCP_OBJECT_LOCK_STALE_AFTER", STALE_AFTER)
    root = f"s3://{TEST_BUCKET}/loop"
    store = ObjectStore(TEST_BUCKET)
    # what an earlier job killed mid-save left: data without .metadata, and its save lock
    store.put("loop/step_0/_rank0_.safetensors", b"partial")
    store.put("loop/.step_0.hp-dcp-lock", b'{"pid": 1}')
    store.put("loop/notes.txt", b"the user's")  # never touched
    steps = step_storage_for(root)
    deadline = time.monotonic() + 30
    while not any(x.kind == "lock" for x in steps.find_leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)  # Last-Modified has one-second resolution: wait until that lock is stale

    with CheckpointManager(root, keep_last=2, keep_every=4) as mgr:
        for step in range(1, 7):
            assert mgr.save(step, _full(step), metrics={"loss": 1.0 / step})
        assert mgr.all_steps() == [4, 5, 6]
        assert mgr.metrics(5) == {"loss": 0.2}
    assert [k for k in _keys("loop/") if "step_0" in k] == []  # the dead save's leftovers are gone
    assert "loop/notes.txt" in _keys("loop/")
    assert not [k for k in _keys("loop/") if "hp-dcp-lock" in k or "readlock" in k]

    with CheckpointManager(root, keep_last=2) as mgr:
        sd = _zeros()
        assert mgr.restore(sd) == 6 and _equal(sd, 6)
        sd = _zeros()
        assert mgr.restore(sd, step=4) == 4 and _equal(sd, 4)
    assert not [k for k in _keys("loop/") if "readlock" in k]  # reader marks released

    # hp-dcp ls: every step, complete or not, with metrics; an incomplete older step is a leftover
    store.put("loop/step_2/_rank0_.safetensors", b"partial")
    capsys.readouterr()
    assert hp_dcp(["ls", root, "--json", "--grace", "0"]) == 0  # as clean --dry-run --grace 0 below
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["complete"]) for s in doc["steps"]] == [(2, False), (4, True), (5, True), (6, True)]
    assert doc["latest"] == 6 and doc["steps"][2]["metrics"] == {"loss": 0.2}
    assert doc["steps"][3]["bytes"] == sum(s for k, s in store.list_objects("loop/step_6/"))
    assert [(x["step"], x["kind"]) for x in doc["leftovers"]] == [(2, "incomplete")]
    assert hp_dcp(["clean", root, "--dry-run", "--grace", "0"]) == 0
    assert "would remove incomplete" in capsys.readouterr().out and _keys("loop/step_2/")
    assert hp_dcp(["clean", root, "--grace", "0"]) == 0
    assert "removed incomplete" in capsys.readouterr().out
    assert _keys("loop/step_2/") == []

    # hp-dcp diff between two s3 checkpoints, and against a local copy
    assert hp_dcp(["diff", f"{root}/step_5", f"{root}/step_6", "--json"]) == 1
    diff = json.loads(capsys.readouterr().out)
    assert diff["keys"]["model.w"]["equal"] is False and diff["keys"]["train.step"]["equal"] is False
    assert diff["keys"]["model.w"]["max_abs"] == pytest.approx(
        float((_full(5)["model"]["w"] - _full(6)["model"]["w"]).abs().max()))
    local = tmp_path / "copy"
    sd = _zeros()
    dcp.load(sd, checkpoint_id=f"{root}/step_6")
    dcp.save(sd, checkpoint_id=str(local), no_dist=True)
    assert hp_dcp(["diff", f"{root}/step_6", str(local)]) == 0
    capsys.readouterr()

    # hp-dcp explain: what a 2-rank column-sharded load of an s3 checkpoint would read
    spec = tmp_path / "target.json"
    spec.write_text(json.dumps({"world_size": 2, "mesh": [2], "default": ["Shard(1)"],
                                "rules": [{"match": "model.b", "placements": ["Replicate"]}]}))
    assert hp_dcp(["explain", f"{root}/step_6", "--target", str(spec), "--json"]) == 0
    exp = json.loads(capsys.readouterr().out)
    assert exp["complete"] is True and exp["checkpoint"] == f"{root}/step_6"
    assert exp["tensors"] == 2 and exp["objects"] == 1 and exp["target"]["world_size"] == 2
    assert all("_rank0_.safetensors" in r["files"] for r in exp["ranks"])


# ----------------------------------------------------------- async saves on two gloo ranks
def _async_worker(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_dcp import CheckpointManager

    mesh = init_device_mesh("cpu", (world_size,))

    def state(step: int, zeros: bool = False) -> dict:
        full = _full(step)
        w = torch.zeros_like(full["model"]["w"]) if zeros else full["model"]["w"]
        return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]),
                          "b": torch.zeros(8, dtype=torch.bfloat16) if zeros else full["model"]["b"]},
                "train": {"step": -1 if zeros else step}}

    with CheckpointManager(root, keep_last=2, async_save=True) as mgr:
        for step in range(1, 5):
            sd = state(step)
            assert mgr.save(step, sd)
            sd["model"]["w"].to_local().fill_(-1.0)  # training goes on: the staged save is unaffected
        mgr.wait()
        kept = mgr.all_steps()
        sd = state(0, zeros=True)
        restored = mgr.restore(sd)
    want = _full(restored)
    ok = (torch.equal(sd["model"]["w"].full_tensor(), want["model"]["w"])
          and torch.equal(sd["model"]["b"], want["model"]["b"]) and sd["train"] == want["train"])
    return kept, restored, ok


@pytest.mark.distributed
def test_manager_async_saves_on_two_ranks_to_s3(s3_test_env):
    root = f"s3://{TEST_BUCKET}/async-loop"
    env = {**s3_test_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
    results = run_distributed(_async_worker, 2, root, env=env, timeout=300)
    assert results == [([3, 4], 4, True), ([3, 4], 4, True)]
    assert _keys("async-loop/step_1/") == [] and _keys("async-loop/step_2/") == []
