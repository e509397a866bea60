"""Leaving a ``with CheckpointManager(...)`` block on an exception, on real gloo ranks.

An exception is often one rank's alone (a bad batch, an out-of-memory error) while the other
ranks train on. The rank that raised must not wait for them in a collective: under torchrun
that hung it for ``HP_DCP_COLLECTIVE_TIMEOUT`` (30 min) before the launcher could restart
the job. Here rank 1 raises right after an async save; rank 0 waits until rank 1 has left
the block before it leaves too. The save in flight still lands, and the next job resumes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

#: Rank 0 waits this long for rank 1 to leave its block; a rank 1 that waited for rank 0 in
#: a collective would stay there for the collective timeout (60 s below), far longer.
LEAVE_WITHIN_S = 30.0


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((4, 3), float(step)), f"rank{rank}": torch.full((2,), float(10 * step + rank))}


def _worker(rank: int, world_size: int, root: str) -> dict:
    from hyper_parallel_dcp import CheckpointManager

    left = Path(root + ".rank1-left")
    out: dict = {}
    try:
        with CheckpointManager(root, keep_last=1, async_save=True) as mgr:
            assert mgr.save(1, _state(1, rank)) and mgr.save(2, _state(2, rank))  # step 2 in flight
            if rank == 1:
                raise RuntimeError("rank 1's own failure")
            deadline = time.monotonic() + LEAVE_WITHIN_S
            while not left.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            out["rank1_left"] = left.exists()
            raise RuntimeError("rank 0 stopped by the launcher")
    except RuntimeError as exc:
        out["error"] = str(exc)
    if rank == 1:
        left.touch()
    # the next job (the same processes, a fresh manager) resumes from the save that was in flight
    with CheckpointManager(root, keep_last=1, async_save=True) as mgr:
        target = _state(0, rank)
        out["restored"] = mgr.restore(target)
        out["values"] = (target["w"].tolist(), target[f"rank{rank}"].tolist())
        out["steps_before"] = mgr.all_steps()
        mgr.save(3, _state(3, rank))
    out["steps_after"] = mgr.all_steps()
    return out


@pytest.mark.distributed
def test_a_rank_leaving_on_an_exception_does_not_wait_for_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_DCP_COLLECTIVE_TIMEOUT", "60")
    root = tmp_path / "run"
    out = run_distributed(_worker, 2, str(root), timeout=240)
    assert out[0]["rank1_left"], out  # rank 1 left while rank 0 was still in its block
    assert out[1]["error"] == "rank 1's own failure" and out[0]["error"] == "rank 0 stopped by the launcher"
    for rank, result in enumerate(out):
        # step 2 landed on both ranks after all; step 1 is still there, since no retention
        # ran on the way out; the next job's first save applies it
        assert result["restored"] == 2, result
        assert result["values"] == ([[2.0] * 3] * 4, [20.0 + rank] * 2), result
        assert result["steps_before"] == [1, 2], result
        assert result["steps_after"] == [3], result
