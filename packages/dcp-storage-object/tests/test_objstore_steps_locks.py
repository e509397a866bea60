"""A checkpoint-manager root on S3 (``ObjectSteps``) and the save lock object, against moto.

Two real saves to one id (one in a subprocess, held mid-write by a marker file) to show
the second is refused; the step storage's rules (``.metadata`` deleted first, readers and
deletions excluding each other, leftovers of dead saves) checked object by object.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, ConcurrentSaveError
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.storage_object import ObjectStore, ObjectStoreReader, ObjectStoreSettings, ObjectStoreWriter
from hyper_parallel_dcp.storage_object.locks import ObjectLease, lock_key
from hyper_parallel_dcp.storage_object.steps import ObjectSteps
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)

QUICK = ObjectStoreSettings(lock_refresh=0.3, lock_stale_after=2.0)


def _save(sd, url, settings=QUICK):
    return save_state_dict(sd, ObjectStoreWriter(url, settings=settings), no_dist=True)


def _load(sd, url):
    load_state_dict(sd, ObjectStoreReader(url, settings=QUICK), no_dist=True)


def _keys(prefix):
    return sorted(k for k, size in ObjectStore(TEST_BUCKET).list_objects(prefix) if size >= 0)


def _wait_for(path, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"the holding save exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# ------------------------------------------------------------------ two saves, one id
_HELD_SAVE = textwrap.dedent("""
    import os, sys, time, torch
    from hyper_parallel_dcp.storage_object import ObjectStoreSettings, ObjectStoreWriter
    from hyper_parallel_dcp.core.pipeline import save_state_dict

    url, started, go = sys.argv[1:4]

    class HeldWriter(ObjectStoreWriter):
        def execute_write(self, plan, planner):
            open(started, "w").close()  # the lock is taken: set_up_storage_writer ran
            while not os.path.exists(go):
                time.sleep(0.02)
            return super().execute_write(plan, planner)

    settings = ObjectStoreSettings(lock_refresh=0.3, lock_stale_after=2.0)
    save_state_dict({"w": torch.arange(12.0), "tag": "first"}, HeldWriter(url, settings=settings), no_dist=True)
""")


def test_second_save_to_the_same_id_is_refused_while_the_first_runs(s3_test_env, tmp_path):
    url = f"s3://{TEST_BUCKET}/twice/step_1"
    started, go = tmp_path / "started", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", _HELD_SAVE, url, str(started), str(go)],
                            env={**os.environ, **s3_test_env})
    try:
        _wait_for(started, proc)
        t0 = time.monotonic()
        with pytest.raises(ConcurrentSaveError, match=f"another save into {url} is in progress .*pid {proc.pid}"):
            _save({"w": torch.zeros(12), "tag": "second"}, url)
        # refused because the holder renewed its lock, not because it timed out
        assert time.monotonic() - t0 < QUICK.lock_stale_after + 10
        go.touch()
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sd = {"w": torch.zeros(12), "tag": ""}
    _load(sd, url)
    assert torch.equal(sd["w"], torch.arange(12.0)) and sd["tag"] == "first"
    assert "twice/.step_1.hp-dcp-lock" not in _keys("twice/")  # released after the commit
    _save({"w": torch.ones(12), "tag": "third"}, url)  # and the id is free again


def test_lock_taken_over_only_when_stale_and_lost_lock_does_not_commit(s3_test_env):
    store = ObjectStore(TEST_BUCKET, QUICK)
    key = lock_key("lease/step_4")
    assert key == "lease/.step_4.hp-dcp-lock"
    first = ObjectLease(store, key, target="s3://ckpts/lease/step_4")
    first.acquire()
    second = ObjectLease(store, key)
    with pytest.raises(ConcurrentSaveError):
        second.acquire(wait=False)
    # the first holder stops renewing (its process "hangs"): the lock turns stale and is taken over
    first._stop.set()
    first._thread.join()
    second.acquire()
    assert second.etag is not None
    # the first holder wakes up: its renewal fails the If-Match, it knows it lost the lock
    assert store.put_if(key, b"renewal", etag=first.etag) is None
    first.lost = True
    with pytest.raises(ConcurrentSaveError, match="taken over"):
        first.check()
    first.release()  # deletes nothing: the lock is the second holder's now
    assert store.stat(key) is not None
    second.release()
    assert store.stat(key) is None


# ------------------------------------------------------------------------ ObjectSteps
def test_object_steps_list_info_size_and_remove(s3_test_env):
    root = f"s3://{TEST_BUCKET}/steps-a"
    steps = ObjectSteps(root, QUICK)
    steps.check_root()
    assert steps.list_steps() == []
    for step in (1, 2, 10):
        steps.write_info(step, {"step": step, "metrics": {"loss": 1.0 / (step + 1)}})
        _save({"w": torch.full((64,), float(step))}, steps.location(step))
    ObjectStore(TEST_BUCKET).put("steps-a/step_11/_rank0_.safetensors", b"partial")  # interrupted
    ObjectStore(TEST_BUCKET).put("steps-a/step_x/notes", b"not a step")
    assert [(e.step, e.complete) for e in steps.list_steps()] == [(1, True), (2, True), (10, True), (11, False)]
    assert steps.location(10) == f"{root}/step_10"
    assert steps.read_info(2)["metrics"] == {"loss": 1.0 / 3}  # the save kept the info object
    assert steps.size_bytes(2) == sum(size for k, size in ObjectStore(TEST_BUCKET).list_objects("steps-a/step_2/"))
    assert abs(steps.saved_at(2) - time.time()) < 120
    assert steps.completeness_problems(2) == [] and steps.completeness_problems(11)
    assert steps.remove_step(1) is True
    assert _keys("steps-a/step_1/") == [] and steps.remove_step(1) is False
    with pytest.raises(Exception, match="holds no checkpoint"):
        _load({"w": torch.zeros(64)}, steps.location(1))


def test_deletion_and_readers_and_saves_exclude_each_other(s3_test_env):
    steps = ObjectSteps(f"s3://{TEST_BUCKET}/steps-b", QUICK)
    _save({"w": torch.ones(8)}, steps.location(3))
    with steps.reading(3):
        assert steps.remove_step(3) is False  # a fresh reader mark keeps it
        assert steps.is_complete(3)
    assert _keys("steps-b/.step_3.hp-dcp-readlock-") == []  # the mark is gone with the reader
    # a save (or a deletion) holding the step's lock: readers back off, deletions too
    held = ObjectLease(steps.store, lock_key("steps-b/step_3"))
    held.acquire()
    try:
        with pytest.raises(CheckpointNotFoundError, match="being deleted or written"):
            with steps.reading(3):
                pass
        assert steps.remove_step(3) is False
        with pytest.raises(ConcurrentSaveError):
            _save({"w": torch.zeros(8)}, steps.location(3), ObjectStoreSettings(lock_refresh=0.3,
                                                                                 lock_stale_after=30))
    finally:
        held.release()
    assert steps.is_complete(3) and steps.remove_step(3) is True


def test_half_deleted_step_is_incomplete_and_a_leftover(s3_test_env):
    store = ObjectStore(TEST_BUCKET)
    steps = ObjectSteps(f"s3://{TEST_BUCKET}/steps-c", QUICK)
    for step in (1, 2, 3, 4):
        _save({"w": torch.full((16,), float(step))}, steps.location(step))
    # a deletion of step 1 that died after its first request: .metadata first, so not complete
    store.delete(["steps-c/step_1/.metadata"])
    store.put("steps-c/step_1/sub/notes.txt", b"mine")  # a step_N prefix is the manager's, whatever it holds
    # a save of step 2 that died: data only, and its lock never renewed again (stale)
    store.delete(["steps-c/step_2/.metadata"])
    store.put("steps-c/.step_2.hp-dcp-lock", b"{}")
    # step 3 incomplete but holding a checkpoint saved without collectives (it loads): left alone
    store.delete(["steps-c/step_3/.metadata"])
    store.put("steps-c/step_3/0.metadata", b"{}")
    assert [(e.step, e.complete) for e in steps.list_steps()] == [(1, False), (2, False), (3, False), (4, True)]
    # step 2's lock is fresh: its save may be running
    assert [(x.step, x.kind) for x in steps.find_leftovers(older_than=4)] == [(1, "incomplete")]
    assert [(x.step, x.kind) for x in steps.find_leftovers(older_than=4, check_running=False)] == [
        (1, "incomplete"), (2, "incomplete")]
    deadline = time.monotonic() + 30
    while len(steps.find_leftovers(older_than=4)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # Last-Modified has a one-second resolution: wait for staleness
    found = steps.find_leftovers(older_than=4)
    assert [(x.step, x.kind) for x in found] == [(1, "incomplete"), (2, "incomplete"), (2, "lock")]
    assert steps.find_leftovers(older_than=4, protected=frozenset({2})) == [found[0]]
    # step 2's clean-up takes the stale lock over and releases it: the lock leftover is gone then
    assert [steps.remove_leftover(x) for x in found] == [True, True, False]
    assert _keys("steps-c/") == ["steps-c/step_3/0.metadata", "steps-c/step_3/_rank0_.safetensors",
                                 "steps-c/step_4/.metadata", "steps-c/step_4/_rank0_.safetensors"]
    sd = {"w": torch.zeros(16)}
    _load(sd, steps.location(4))
    assert torch.equal(sd["w"], torch.full((16,), 4.0))


def test_lock_of_a_dead_process_on_this_machine_is_a_leftover_at_once(s3_test_env):
    import json

    from hyper_parallel_dcp.storage_object.locks import _machine, _process_start

    steps = ObjectSteps(f"s3://{TEST_BUCKET}/steps-d", ObjectStoreSettings(lock_stale_after=600))
    for step in (1, 2):
        _save({"w": torch.full((4,), float(step))}, steps.location(step))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = ObjectStore(TEST_BUCKET)
    store.delete(["steps-d/step_1/.metadata"])  # its save died mid-way, on this machine
    store.put("steps-d/.step_1.hp-dcp-lock", json.dumps({"pid": dead.pid, "start": "1", **_machine()}).encode())
    alive = {"pid": os.getpid(), "start": _process_start(os.getpid()), **_machine()}
    store.put("steps-d/.step_2.hp-dcp-readlock-abc123", json.dumps(alive).encode())  # a live reader
    found = steps.find_leftovers(older_than=2)
    assert [(x.step, x.kind) for x in found] == [(1, "incomplete"), (1, "lock")]  # no wait for 600 s
    assert [steps.remove_leftover(x) for x in found] == [True, False]  # the clean-up took the lock over
    assert _keys("steps-d/") == ["steps-d/.step_2.hp-dcp-readlock-abc123", "steps-d/step_2/.metadata",
                                 "steps-d/step_2/_rank0_.safetensors"]
    assert steps.remove_step(2) is False  # the live reader's mark keeps it
