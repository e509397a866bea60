"""A training script whose last act is a synchronous save exits with status 0 on every rank.

Before ``core/exit_drain.py`` a gloo rank could die of SIGABRT at interpreter exit
(``terminate called without an active exception``): a gloo worker thread still releasing
the save's last collective needed the GIL after finalization had begun.  The script here
makes that race likely — each rank pinned to one CPU, no forced GIL switches, no
``destroy_process_group()`` — and is launched 4 times as real processes (~12 s here).
Measured on 2 busy cores with the drain switched off (``--no-drain``): 8 of 24 ranks
aborted, in 7 of 12 launches (so 4 launches catch it ~97% of the time); with the drain,
0 of 60 ranks in 30 launches.
The unit tests below check the drain itself.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core import exit_drain

_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist

    if __name__ == "__main__":
        rank, world, store, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
        import hyper_parallel_dcp as dcp
        if "--no-drain" in sys.argv:  # to measure what the test catches without the fix
            import hyper_parallel_dcp.core.exit_drain as exit_drain
            exit_drain.install = lambda: None
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        # One CPU per rank and no forced GIL hand-over: the gloo worker that completes the
        # last collective is preempted by the main thread it wakes, which runs on to exit.
        os.sched_setaffinity(0, {rank % os.cpu_count()})
        sys.setswitchinterval(5.0)
        full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
        sd = {"rows": full[rank * 4:(rank + 1) * 4].clone(), "shared": torch.full((5,), 3.0), "step": 7}
        from hyper_parallel_dcp.core.ragged import RaggedShard
        sd["rows"] = RaggedShard.from_rows(sd["rows"], (8, 6), rank * 4)
        dcp.save(sd, checkpoint_id=ckpt)
        print("saved", flush=True)
        # no destroy_process_group(): the save is the last thing the script does
''')


def _launch(script: Path, tmp: Path, run: int, *extra: str) -> list[subprocess.CompletedProcess]:
    store, ckpt = tmp / f"store{run}", tmp / f"ckpt{run}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(store), str(ckpt), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
             for r in range(2)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]


@pytest.mark.distributed
def test_script_ending_in_a_save_exits_cleanly(tmp_path: Path) -> None:
    import hyper_parallel_dcp as dcp

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    for run in range(4):
        for rank, out in enumerate(_launch(script, tmp_path, run)):
            assert out.returncode == 0, f"launch {run} rank {rank}: exit {out.returncode}\n{out.stderr[-2000:]}"
            assert out.stdout.strip() == "saved"
        target = {"rows": torch.zeros(8, 6), "shared": torch.zeros(5), "step": None}
        dcp.load(target, checkpoint_id=tmp_path / f"ckpt{run}", no_dist=True)
        assert torch.equal(target["rows"], torch.arange(48, dtype=torch.float32).reshape(8, 6))
        assert torch.equal(target["shared"], torch.full((5,), 3.0))
        assert target["step"] == 7


class _Hashing(threading.Thread):
    """Hashes a large buffer over and over: hashlib releases the GIL, so it stays runnable."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.started_hashing = threading.Event()
        self.stop = threading.Event()
        self.data = os.urandom(16 << 20)

    def run(self) -> None:
        while not self.stop.is_set():
            hashlib.sha256(self.data).digest()
            self.started_hashing.set()


def test_runnable_threads_sees_a_running_thread() -> None:
    me = threading.get_native_id()
    worker = _Hashing()
    worker.start()
    try:
        assert worker.started_hashing.wait(30)
        seen = [exit_drain.runnable_threads(me) for _ in range(200)]
    finally:
        worker.stop.set()
        worker.join()
    assert max(n for n in seen if n is not None) >= 1


def test_drain_waits_for_a_running_thread_at_most_its_limit() -> None:
    worker = _Hashing()
    worker.start()
    try:
        assert worker.started_hashing.wait(30)
        started = time.monotonic()
        quiet = exit_drain.drain_collective_threads(limit=0.05)
        took = time.monotonic() - started
    finally:
        worker.stop.set()
        worker.join()
    assert quiet is False
    assert 0.05 <= took < 10  # bounded: a thread that keeps running does not hold up exit
    # once it has stopped, the process goes quiet
    assert exit_drain.drain_collective_threads(limit=5.0) is True


def test_drain_hands_the_gil_to_a_waiting_thread() -> None:
    # The gloo worker's release at exit is a thread waiting for the GIL that the main
    # thread holds: the drain must let such a thread run.
    go, ran = threading.Event(), threading.Event()

    def wants_the_gil() -> None:
        go.wait()
        ran.set()

    thread = threading.Thread(target=wants_the_gil, daemon=True)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # no forced hand-over: only the drain's pauses let it run
    try:
        go.set()  # the thread can go on, but only once it holds the GIL
        assert not ran.is_set()
        exit_drain.drain_collective_threads(limit=5.0)
        assert ran.is_set()
    finally:
        sys.setswitchinterval(interval)
    thread.join()
