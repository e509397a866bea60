"""Fault injection with real processes: ranks killed mid-save, disk full, concurrent saves.

Each case first saves a good checkpoint into a directory, then a second save into the same
directory fails in a chosen way.  Checked every time: the surviving ranks get a clear error
(naming the phase, the absent rank or the file), the earlier checkpoint still loads with its
own values, and the failed save left no ``.metadata`` of its own.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_ranks as _run_ranks

OLD = 1.0
NEW = 2.0
TIMEOUT_S = "10"


def _state(value: float, rank: int) -> dict:
    # "w" is replicated (written once), "own" differs per rank (each rank writes its part).
    return {"w": torch.full((64, 8), value), f"own{rank}": torch.full((32,), value + rank), "step": int(value)}


# ----------------------------------------------------------------------- the harness
def run_ranks(fn, world_size: int, *args, timeout: float = 180.0, env: dict | None = None) -> dict:
    """``core.testing.run_ranks`` with a short collective timeout: a dead peer is noticed fast."""
    return _run_ranks(fn, world_size, *args, timeout=timeout,
                      env={"HP_DCP_COLLECTIVE_TIMEOUT": TIMEOUT_S, **(env or {})})


def _load_values(path: Path, world_size: int = 2) -> dict:
    from hyper_parallel_dcp import load

    target = {"w": torch.zeros(64, 8), "step": -1}
    for r in range(world_size):
        target[f"own{r}"] = torch.zeros(32)
    load(target, checkpoint_id=path, no_dist=True, verify=True)
    return target


def _assert_old_intact(path: Path, world_size: int = 2) -> None:
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    report = verify_checkpoint(path)
    assert report.ok, report.problems
    got = _load_values(path, world_size)
    assert torch.equal(got["w"], torch.full((64, 8), OLD))
    for r in range(world_size):
        assert torch.equal(got[f"own{r}"], torch.full((32,), OLD + r))
    assert got["step"] == int(OLD)


def _no_partial_metadata(path: Path) -> None:
    """No metadata other than the old checkpoint's own: nothing the failed save wrote."""
    names = sorted(os.listdir(path))
    assert ".metadata" in names
    assert not [n for n in names if n.endswith(".metadata") and n != ".metadata"], names
    assert not [n for n in names if n.endswith(".hp-dcp-tmp")], names


# ----------------------------------------------------------------------- the workers
def _save_then_fail(rank: int, world_size: int, path: str, fault: str) -> str:
    """Save OLD collectively, then NEW with ``fault`` injected; returns the error text."""
    import signal as _signal

    from hyper_parallel_dcp import save
    from hyper_parallel_dcp.core import collectives
    from hyper_parallel_dcp.storage_fs import atomic, rank_files, writer

    save(_state(OLD, rank), checkpoint_id=path)

    def die() -> None:
        os.kill(os.getpid(), _signal.SIGKILL)

    if fault == "kill_write" and rank == 1:
        real = rank_files.write_safetensors

        def half_then_die(f, entries, *args, **kwargs):  # part of the chunks: their own header
            real(f, entries[:1])  # part of the file is on disk, then the rank is killed
            f.flush()
            die()

        rank_files.write_safetensors = half_then_die
    elif fault == "kill_exchange" and rank == 1:
        real_gather = collectives.DistWrapper.gather_object

        def gather_then_die(self, obj):
            if self._step == "write":  # the write results (the metadata exchange)
                die()
            return real_gather(self, obj)

        collectives.DistWrapper.gather_object = gather_then_die
    elif fault == "kill_metadata" and rank == 0:
        # the coordinator writes .metadata under its temp name while the ranks' fsyncs run
        real_write = writer.write_file_pending

        def metadata_half_then_die(p, data_writer, **kwargs):
            if p.name == ".metadata":
                buf = io.BytesIO()
                data_writer(buf)
                tmp = p.with_name(p.name + atomic.TMP_SUFFIX)
                tmp.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
                die()
            return real_write(p, data_writer, **kwargs)

        writer.write_file_pending = metadata_half_then_die
    elif fault == "enospc" and rank == 1:
        atomic.open = _full_disk_open  # every checkpoint file write now hits a full disk
    try:
        save(_state(NEW, rank), checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _FullFile(io.FileIO):
    """A file on a disk with 100 bytes left: writes past that fail with ENOSPC."""

    def write(self, data):  # type: ignore[override]
        if self.tell() + len(memoryview(data)) > 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def _full_disk_open(file, mode="r", *args, **kwargs):
    if "w" in mode:
        return io.BufferedWriter(_FullFile(file, "w"), buffer_size=16)
    return open(file, mode, *args, **kwargs)


# ----------------------------------------------------------------------- the tests
@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault, survivor, phase, absent",
    [
        ("kill_write", 0, "write", 1),
        ("kill_exchange", 0, "write", 1),
        ("kill_metadata", 1, "write", 0),
    ],
)
def test_rank_killed_mid_save(tmp_path: Path, fault: str, survivor: int, phase: str, absent: int) -> None:
    path = tmp_path / "ckpt"
    out = run_ranks(_save_then_fail, 2, str(path), fault)
    assert out[absent][0] == "died", out
    status, text = out[survivor]
    assert status == "ok", text
    assert text.startswith("CheckpointTimeoutError"), text
    assert f"phase '{phase}'" in text and f"rank(s) [{absent}] did not arrive" in text, text
    _no_partial_metadata(path)
    _assert_old_intact(path)
    # The next save takes over: leftovers of the dead save are cleaned, the new data lands.
    from hyper_parallel_dcp import save

    save({"w": torch.full((64, 8), 3.0), "own0": torch.zeros(32), "own1": torch.ones(32), "step": 3},
         checkpoint_id=path, no_dist=True)
    from hyper_parallel_dcp.storage_fs import wait_for_removals

    assert wait_for_removals(timeout=60)  # the checkpoint it replaced is deleted in the background
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.hp-dcp-staging")]
    assert _load_values(path)["step"] == 3


@pytest.mark.distributed
def test_disk_full_on_one_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    out = run_ranks(_save_then_fail, 2, str(path), "enospc")
    for rank in (0, 1):
        status, text = out[rank]
        assert status == "ok", text
        assert "rank(s) 1" in text and "No space left on device" in text, text
        assert "_rank1_.safetensors" in text, text  # the file that could not be written
    _no_partial_metadata(path)
    _assert_old_intact(path)
    assert not [p for p in tmp_path.iterdir() if "hp-dcp-staging" in p.name]


def _save_while_locked(rank: int, world_size: int, path: str) -> str:
    from hyper_parallel_dcp import save

    try:
        save(_state(NEW, rank), checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.distributed
def test_concurrent_save_refused_on_every_rank(tmp_path: Path) -> None:
    """While another save holds the directory, every rank of a second save fails fast."""
    from hyper_parallel_dcp import save
    from hyper_parallel_dcp.storage_fs.commit import SaveLock

    path = tmp_path / "ckpt"
    save({**_state(OLD, 0), **{"own1": torch.full((32,), OLD + 1)}}, checkpoint_id=path, no_dist=True)
    lock = SaveLock(path)
    lock.acquire()
    try:
        out = run_ranks(_save_while_locked, 2, str(path), env={"HP_DCP_COLLECTIVE_TIMEOUT": "600"}, timeout=120)
    finally:
        lock.release()
    for rank in (0, 1):
        status, text = out[rank]
        assert status == "ok", text
        assert "another save into" in text and "is in progress" in text, text
    _assert_old_intact(path)


_SLOW_SAVER = """
import sys, torch
from hyper_parallel_dcp import save
from hyper_parallel_dcp.storage_fs import rank_files
real = rank_files.write_safetensors
def slow(f, entries, *args, **kwargs):
    open(sys.argv[2], "w").close()  # tell the test we are inside the save (holding the lock)
    sys.stdin.readline()  # and stay there until the test says go (a line, or stdin closed)
    return real(f, entries, *args, **kwargs)
rank_files.write_safetensors = slow
value = float(sys.argv[3])
try:
    save({"w": torch.full((64, 8), value), "own0": torch.full((32,), value), "own1": torch.full((32,), value + 1),
          "step": int(value)}, checkpoint_id=sys.argv[1], no_dist=True)
    print("saved")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_two_processes_save_into_one_directory(tmp_path: Path) -> None:
    """Two independent jobs save into one directory at once: one is refused, never a mix."""
    from hyper_parallel_dcp import save

    path = tmp_path / "ckpt"
    save({"w": torch.full((64, 8), OLD), "own0": torch.full((32,), OLD), "own1": torch.full((32,), OLD + 1),
          "step": 1}, checkpoint_id=path, no_dist=True)
    inside = tmp_path / "inside"
    # The first save waits inside its write, holding the lock, until the test writes to its
    # stdin: the second save meets the lock however long it takes to start (no time window).
    first = subprocess.Popen([sys.executable, "-c", _SLOW_SAVER, str(path), str(inside), "5"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not inside.exists():
        assert first.poll() is None and time.monotonic() < deadline, "first saver never started writing"
        time.sleep(0.1)
    # The first save is writing; the old checkpoint must still load meanwhile.
    _assert_old_intact(path)
    second = subprocess.run([sys.executable, "-c", _SLOW_SAVER, str(path), str(tmp_path / "x"), "7"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, timeout=120)
    assert second.stdout.startswith("ConcurrentSaveError"), second.stdout
    assert not (tmp_path / "x").exists(), "the refused save must not have reached its write"
    assert first.communicate("go\n", timeout=120)[0].strip() == "saved"
    got = _load_values(path)
    assert torch.equal(got["w"], torch.full((64, 8), 5.0)) and got["step"] == 5


def test_sigkill_during_single_process_save(tmp_path: Path) -> None:
    """A save process killed at a random moment mid-write: the old checkpoint stays whole."""
    from hyper_parallel_dcp import save

    path = tmp_path / "ckpt"
    save({"w": torch.full((64, 8), OLD), "own0": torch.full((32,), OLD), "own1": torch.full((32,), OLD + 1),
          "step": 1}, checkpoint_id=path, no_dist=True)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SAVER, str(path), str(tmp_path / "inside"), "9"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "inside").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _no_partial_metadata(path)
    _assert_old_intact(path)


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    return res.returncode == 0


def test_disk_full_on_a_real_tiny_tmpfs(tmp_path: Path) -> None:
    """A real ENOSPC from the kernel (a 1 MiB tmpfs), where this machine lets us mount one."""
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("mounting a tmpfs is not permitted here (the monkeypatched ENOSPC test covers the logic)")
    try:
        from hyper_parallel_dcp import load, save

        path = mnt / "ckpt"
        small = {"w": torch.full((64, 8), OLD), "step": 1}
        save(small, checkpoint_id=path, no_dist=True)
        with pytest.raises(OSError) as info:
            save({"w": torch.full((512, 1024), NEW), "step": 2}, checkpoint_id=path, no_dist=True)
        assert info.value.errno == errno.ENOSPC
        assert "_rank0_.safetensors" in str(info.value)
        assert sorted(os.listdir(mnt)) == ["ckpt"]  # staging removed, space given back
        target = {"w": torch.zeros(64, 8), "step": 0}
        load(target, checkpoint_id=path, no_dist=True, verify=True)
        assert torch.equal(target["w"], small["w"]) and target["step"] == 1
    finally:
        # a file still mapped or a background removal still running keeps the mount busy:
        # detach it then, so that no tmpfs outlives the test
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
