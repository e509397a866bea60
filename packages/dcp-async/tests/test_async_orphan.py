"""A writer process whose training process was SIGKILLed mid-save exits at once.

Two real training processes (gloo over a file store) call ``async_save(use_gloo=True)``.
Rank 1's storage writer writes its data and then stops before returning its write
results (a marker file says so); rank 0's writer has written its data and waits in the
gather of write results.  The test SIGKILLs training processes, as a launcher does when a
rank dies, and checks that the orphaned writers are gone well before the 1800 s
``HP_DCP_ASYNC_TIMEOUT`` (set to 600 s here), that nothing was committed, and that the
next save into the same directory lands.

``all``: both training processes are killed at once (what torchrun does).  ``one``: rank
1's first; its writer must be gone while rank 0's writer still waits for rank 1's write
results (and must not commit without them); then rank 0's.  (A surviving rank that is
never killed waits for the writers' timeouts, ``HP_DCP_ASYNC_TIMEOUT`` and the arrival
check's ``HP_DCP_COLLECTIVE_TIMEOUT``: no rank is left to report the failure on the job's
outcome board.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair
from hyper_parallel_dcp.storage_fs.testing import load, save

_SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch, torch.distributed as dist
    from hyper_parallel_dcp.async_persist import async_save
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    class StoppingWriter(FileSystemWriter):
        """Writes its data, leaves a marker, and (``stop``) never returns its results."""

        def __init__(self, path, marker, stop):
            super().__init__(path)
            self.marker, self.stop = marker, stop

        def execute_write(self, plan, planner):
            results = super().execute_write(plan, planner)
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            while self.stop:
                time.sleep(0.05)
            return results

    if __name__ == "__main__":
        rank, store, ckpt, markers = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        full = torch.arange(40, dtype=torch.float32).reshape(8, 5)
        sd = {f"w{rank}": full[rank * 4:(rank + 1) * 4].clone(), "step": 3}
        writer = StoppingWriter(ckpt, os.path.join(markers, f"wrote{rank}"), stop=rank == 1)
        resp = async_save(sd, storage_writer=writer, use_gloo=True)
        print(f"returned writer={resp.writer_pid}", flush=True)
        try:
            resp.get_result()
            print("landed", flush=True)
        except Exception as exc:
            print(f"failed {type(exc).__name__}", flush=True)
''')

_DEADLINE_S = 60.0  # generous: the writers watch for their parent every 0.25 s at most


def _alive(pid: int) -> bool:
    """Whether any thread of ``pid`` still runs.

    A zombie whose threads have all exited counts as gone (nobody may reap it soon); a
    leader that is a zombie while another thread still exits does not: that thread still
    holds the process's files (the save lock, the sockets).
    """
    task_dir = Path(f"/proc/{pid}/task")
    if not Path("/proc/self/task").is_dir():  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        tasks = os.listdir(task_dir)
    except (FileNotFoundError, ProcessLookupError):
        return False
    for tid in tasks:
        try:
            state = (task_dir / tid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], deadline: float) -> None:
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"training process exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no marker {paths} within the deadline")
        time.sleep(0.05)


@pytest.mark.distributed
@pytest.mark.parametrize("killed", ["all", "one"])
def test_orphaned_writer_abandons_its_save_and_exits(tmp_path: Path, killed: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    ckpt, markers = tmp_path / "ckpt", tmp_path / "markers"
    markers.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair()), HP_DCP_ASYNC_TIMEOUT="600")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(ckpt), str(markers)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for r in range(2)]
    try:
        _wait_for([markers / "wrote0", markers / "wrote1"], procs, time.monotonic() + 240)
        writers = [int((markers / f"wrote{r}").read_text()) for r in range(2)]
        assert all(_alive(pid) for pid in writers)
        waves = [(procs, writers)] if killed == "all" else [(procs[1:], writers[1:]), (procs[:1], writers[:1])]
        for victims, orphans in waves:
            for proc in victims:
                proc.send_signal(signal.SIGKILL)
            for proc in victims:
                proc.wait(timeout=30)
            deadline = time.monotonic() + _DEADLINE_S
            while any(_alive(pid) for pid in orphans) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not [pid for pid in orphans if _alive(pid)], "an orphaned writer is still running"
            assert not (ckpt / ".metadata").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # nothing was committed: no checkpoint at the target, at most a hidden staging directory
    assert not (ckpt / ".metadata").exists()
    with pytest.raises(Exception):  # noqa: B017 - any refusal; what matters is that nothing loads
        load({"step": None}, checkpoint_id=ckpt, no_dist=True)
    # the next save into that directory lands and loads its own values
    sd = {"w": torch.arange(6.0), "step": 4}
    save(sd, checkpoint_id=ckpt, no_dist=True)
    back = {"w": torch.zeros(6), "step": None}
    load(back, checkpoint_id=ckpt, no_dist=True)
    assert torch.equal(back["w"], torch.arange(6.0)) and back["step"] == 4


_WATCH = textwrap.dedent('''
    import os, subprocess, sys
    if sys.argv[1] == "middle":  # starts the watcher, says its pid, then waits to be killed
        child = subprocess.Popen([sys.executable, __file__, "watch", str(os.getpid()), sys.argv[2], sys.argv[3]])
        print(child.pid, flush=True)
        sys.stdin.read()
    else:
        _, _, parent, marker, pidfd = sys.argv
        if pidfd == "no":
            del os.pidfd_open  # the portable path: getppid() polling
        from hyper_parallel_dcp.async_persist.writer import wait_for_parent_exit
        open(marker + ".ready", "w").close()
        wait_for_parent_exit(int(parent))
        open(marker, "w").close()
''')


@pytest.mark.parametrize("pidfd", ["yes", "no"])
def test_wait_for_parent_exit_returns_once_the_parent_is_killed(tmp_path: Path, pidfd: str) -> None:
    if pidfd == "yes" and not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open on this platform")  # the "no" case covers it
    script, marker = tmp_path / "watch.py", tmp_path / "gone"
    script.write_text(_WATCH)
    middle = subprocess.Popen([sys.executable, str(script), "middle", str(marker), pidfd],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        watcher = int(middle.stdout.readline())  # type: ignore[union-attr]
        deadline = time.monotonic() + 120
        while not Path(f"{marker}.ready").exists():
            assert time.monotonic() < deadline and _alive(watcher), "the watcher did not start"
            time.sleep(0.05)
        assert not marker.exists()  # the parent lives: still waiting
        middle.send_signal(signal.SIGKILL)
        middle.wait(timeout=30)
        deadline = time.monotonic() + _DEADLINE_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "wait_for_parent_exit did not return after its parent was killed"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
