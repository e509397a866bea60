"""The save lock, the crash-safe commit and the integrity checks of storage-fs, without the
umbrella (this package's own test environment holds only core and storage-fs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.errors import ConcurrentSaveError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import metadata_from_json
from hyper_parallel_dcp.storage_fs.commit import SaveLock, remove_stale_staging, staging_dir, wait_for_removals
from hyper_parallel_dcp.storage_fs.integrity import check_complete, verify_checkpoint
from hyper_parallel_dcp.storage_fs.testing import load, save


def _state(value: float) -> dict:
    return {"w": torch.full((16, 4), value), "b": torch.arange(6.0) + value, "meta": {"step": int(value)}}


def _blank() -> dict:
    return {"w": torch.zeros(16, 4), "b": torch.zeros(6), "meta": {"step": -1}}


def _loaded(path: Path, verify: bool = False) -> dict:
    target = _blank()
    load(target, checkpoint_id=path, no_dist=True, verify=verify)
    return target


def _assert_values(got: dict, value: float) -> None:
    ref = _state(value)
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"]) and got["meta"] == ref["meta"]


# ------------------------------------------------------------------------ the lock
def test_a_held_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    first = SaveLock(target)
    first.acquire()
    try:
        with pytest.raises(ConcurrentSaveError, match=f"another save into {target} is in progress") as err:
            SaveLock(target).acquire()  # a separate open file: flock conflicts even in one process
        assert f'"pid": {os.getpid()}' in str(err.value)
    finally:
        first.release()
    assert not first.path.exists(), "release leaves no lock file behind"
    second = SaveLock(target)
    second.acquire()  # free again
    second.release()


def test_a_save_into_a_locked_directory_fails_and_the_old_checkpoint_stays(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    lock = SaveLock(path)
    lock.acquire()
    try:
        with pytest.raises(ConcurrentSaveError):
            save(_state(2.0), checkpoint_id=path, no_dist=True)
    finally:
        lock.release()
    _assert_values(_loaded(path), 1.0)
    assert not [p.name for p in tmp_path.iterdir() if "hp-dcp-staging" in p.name]


# ---------------------------------------------------------------------- the commit
def test_a_new_save_replaces_the_old_keeping_user_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    (path / "notes.txt").write_text("mine")
    (path / "extra").mkdir()
    (path / "extra" / "cfg.json").write_text("{}")
    save(_state(2.0), checkpoint_id=path, no_dist=True)
    _assert_values(_loaded(path), 2.0)
    assert (path / "notes.txt").read_text() == "mine" and (path / "extra" / "cfg.json").read_text() == "{}"
    # the replaced checkpoint is deleted in the background: at most it is still going
    # (one listing: a second look could miss a staging directory the first one saw)
    beside = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert all(name.startswith(".ckpt.hp-dcp-staging-") for name in beside), beside
    assert wait_for_removals(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "no staging, trash or lock left beside it"


def test_staging_left_by_a_dead_save_is_removed_and_never_loaded(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    dead = staging_dir(path, "deadbeef")
    dead.mkdir()
    (dead / "_rank0_.safetensors").write_bytes(b"half a file")
    _assert_values(_loaded(path), 1.0)  # the target is untouched by the dead save
    keep = staging_dir(path, "live")
    keep.mkdir()
    assert remove_stale_staging(path, keep="live") == [dead]
    assert keep.exists() and not dead.exists()


def test_the_next_save_cleans_up_after_a_dead_one(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    staging_dir(path, "deadbeef").mkdir(parents=True)
    save(_state(3.0), checkpoint_id=path, no_dist=True)
    _assert_values(_loaded(path), 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -------------------------------------------------------------- completeness, verify
def _data_file(path: Path) -> Path:
    return path / "_rank0_.safetensors"


def test_a_saved_checkpoint_is_complete_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    assert check_complete(path).complete
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    stored = sum(os.path.getsize(p) for p in path.iterdir() if p.name.startswith("_rank"))
    header = 8 + int.from_bytes(_data_file(path).read_bytes()[:8], "little")
    assert report.bytes_checked == stored - header  # every data byte, no header byte
    _assert_values(_loaded(path, verify=True), 1.0)


def test_a_flipped_byte_is_named_by_verify_and_refused_by_a_verified_load(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    raw = bytearray(_data_file(path).read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor in the file
    _data_file(path).write_bytes(bytes(raw))
    assert check_complete(path).complete  # sizes are intact: only checksums can tell
    report = verify_checkpoint(path)
    assert not report.ok
    assert any("_rank0_.safetensors" in p and "checksum" in p for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in .*_rank0_.safetensors"):
        _loaded(path, verify=True)


def test_a_truncated_file_or_missing_metadata_is_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(1.0), checkpoint_id=path, no_dist=True)
    recorded = metadata_from_json((path / ".metadata").read_bytes()).files["_rank0_.safetensors"]
    os.truncate(_data_file(path), recorded - 4)
    report = check_complete(path)
    assert not report.complete and any("_rank0_.safetensors" in p for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match="_rank0_.safetensors"):
        _loaded(path)
    (path / ".metadata").unlink()
    assert not check_complete(path).complete
