"""CheckpointManager on ``s3://`` under SIGKILL (moto's S3 server on 127.0.0.1, gloo ranks).

The coordinator is killed in the middle of writing step 4, and (another root) in the middle
of retention's deletion of step 2, right after its ``.metadata`` went.  A fresh set of
processes then restores the newest step that had been complete (values checked), saves
on, and that save's retention removes what the dead job left: the incomplete steps and
the lock objects of the dead saves — at once, since their holders ran on this machine
(the lock staleness is set to 10 minutes to show it is not waited for).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed, run_ranks
from hyper_parallel_dcp.storage_object import ObjectStore
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)

ENV = {"HP_DCP_COLLECTIVE_TIMEOUT": "5", "HP_DCP_OBJECT_LOCK_STALE_AFTER": "600"}


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((16, 4), float(step)), f"own{rank}": torch.arange(8.0) + 100 * step + rank,
            "train": {"step": step}}


def _zeros(rank: int) -> dict:
    return {"w": torch.zeros(16, 4), f"own{rank}": torch.zeros(8), "train": {"step": -1}}


def _die() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _crash_worker(rank: int, world_size: int, root: str, fault: str) -> str:
    """Save steps 1-3 (keep_last=2), then the coordinator dies at the chosen moment of step 4."""
    from hyper_parallel_dcp import CheckpointManager
    from hyper_parallel_dcp.storage_fs import rank_files
    from hyper_parallel_dcp.storage_object import client

    mgr = CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, _state(step, rank))
    if fault == "save" and rank == 0:
        real_write = rank_files.write_safetensors

        def half_then_die(f, entries, *args, **kwargs):  # part of the chunks: their own header
            real_write(f, entries[:1])
            _die()

        rank_files.write_safetensors = half_then_die
    elif fault == "retention" and rank == 0:
        real_delete = client.ObjectStore.delete

        def delete_then_die(self, keys):
            real_delete(self, keys)
            if any(k.endswith("step_2/.metadata") for k in keys):
                _die()  # step 2 lost its .metadata, its data is still there

        client.ObjectStore.delete = delete_then_die
    try:
        mgr.save(4, _state(4, rank))
        mgr.close()
    except Exception as exc:  # noqa: BLE001 - the survivor's error is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _resume_worker(rank: int, world_size: int, roots: list[str]) -> list[tuple[int, list[int]]]:
    from hyper_parallel_dcp import CheckpointManager

    out = []
    for root in roots:
        with CheckpointManager(root, keep_last=2) as mgr:
            target = _zeros(rank)
            step = mgr.restore(target)
            assert step is not None
            assert torch.equal(target["w"], torch.full((16, 4), float(step))), (root, step)
            assert torch.equal(target[f"own{rank}"], torch.arange(8.0) + 100 * step + rank), (root, step)
            assert target["train"] == {"step": step}
            mgr.save(step + 2, _state(step + 2, rank))
            out.append((step, mgr.all_steps()))
    return out


def _names(prefix: str) -> list[str]:
    """Object names directly under ``prefix`` and the step prefixes that hold any object."""
    keys = [k for k, size in ObjectStore(TEST_BUCKET).list_objects(prefix) if size >= 0]
    return sorted({k[len(prefix):].split("/", 1)[0] for k in keys})


@pytest.mark.distributed
def test_coordinator_killed_mid_save_and_mid_retention_then_resume(s3_test_env):
    faults = ["save", "retention"]
    roots = {f: f"s3://{TEST_BUCKET}/crash-{f}" for f in faults}
    store = ObjectStore(TEST_BUCKET)
    env = {**s3_test_env, **ENV}
    for fault in faults:
        store.put(f"crash-{fault}/keep_me/data.txt", fault.encode())  # the user's: never touched
        out = run_ranks(_crash_worker, 2, roots[fault], fault, timeout=180, env=env)
        assert out[0][0] == "died", (fault, out)
        status, text = out[1]
        assert status == "ok" and "did not arrive" in text, (fault, out)  # the survivor got an error, no hang
    # what the dead job left
    assert _names("crash-save/") == [".step_4.hp-dcp-lock", "keep_me", "step_2", "step_3", "step_4"]
    assert store.size("crash-save/step_4/.metadata") is None
    assert _names("crash-retention/") == [".step_2.hp-dcp-lock", "keep_me", "step_2", "step_3", "step_4"]
    assert store.size("crash-retention/step_2/.metadata") is None  # half deleted: incomplete, not complete
    assert store.size("crash-retention/step_2/_rank0_.safetensors") is not None

    results = run_distributed(_resume_worker, 2, [roots[f] for f in faults], timeout=240, env=env)
    expected = {"save": 3, "retention": 4}
    for rank_result in results:
        for fault, (step, steps) in zip(faults, rank_result):
            assert step == expected[fault], (fault, step)
            assert steps == [step, step + 2], (fault, steps)
    for fault in faults:
        step = expected[fault]
        # the dead job's leftovers (incomplete steps, lock objects) are gone, the user's object is not
        assert _names(f"crash-{fault}/") == ["keep_me", f"step_{step}", f"step_{step + 2}"], fault
        assert store.get(f"crash-{fault}/keep_me/data.txt") == fault.encode()
