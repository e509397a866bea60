"""CheckpointManager when a save fails on one rank only, on real gloo ranks.

A trainer that catches the error and goes on training must get it once, on every rank, from
the call that failed, and the next save must work: rank 1's ``Stateful.state_dict()`` raises
at step 2 (sync and async), training continues, steps 3 and 4 are saved, and retention,
``wait()`` and ``restore`` behave as if step 2 had never been asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

FAIL_AT = 2


class _Counter:
    """A ``Stateful`` whose ``state_dict()`` fails on rank 1 at ``FAIL_AT``."""

    def __init__(self, rank: int):
        self.rank, self.value = rank, 0

    def state_dict(self) -> dict:
        if self.rank == 1 and self.value == FAIL_AT:
            raise RuntimeError(f"counter of rank 1 cannot be read at step {self.value}")
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["value"])


def _state(step: int, rank: int) -> dict:
    counter = _Counter(rank)
    counter.value = step
    return {"w": torch.full((4, 3), float(step)), "counter": counter}


def _failing_rank_worker(rank: int, world_size: int, root: str, use_async: bool) -> dict:
    from hyper_parallel_dcp import CheckpointManager

    errors: dict[int, str] = {}
    saved: dict[int, bool] = {}
    with CheckpointManager(root, keep_last=2, async_save=use_async) as mgr:
        for step in range(1, 5):
            try:
                saved[step] = mgr.save(step, _state(step, rank))
            except Exception as exc:  # noqa: BLE001 - the trainer goes on, as a real one may
                errors[step] = f"{type(exc).__name__}: {exc}"
        mgr.wait()
        steps = mgr.all_steps()
        target = _state(0, rank)
        restored = mgr.restore(target)
    return {"errors": errors, "saved": saved, "steps": steps, "restored": restored,
            "w": target["w"].tolist(), "counter": target["counter"].value}


@pytest.mark.distributed
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_save_failing_on_one_rank_is_raised_once_and_the_next_saves_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_async: bool) -> None:
    # a rank left waiting in a collective would fail after this instead of 30 minutes
    monkeypatch.setenv("HP_DCP_COLLECTIVE_TIMEOUT", "60")
    root = tmp_path / "run"
    out = run_distributed(_failing_rank_worker, 2, str(root), use_async, timeout=240)
    for rank, result in enumerate(out):
        # raised by the call that failed, on every rank, naming the rank and the cause; only once
        assert list(result["errors"]) == [FAIL_AT], (rank, result["errors"])
        assert "rank" in result["errors"][FAIL_AT] and "1" in result["errors"][FAIL_AT]
        assert "cannot be read at step 2" in result["errors"][FAIL_AT], result["errors"][FAIL_AT]
        if use_async:  # the phase names what failed: the save's start, not retention
            assert "start the async save of step 2" in result["errors"][FAIL_AT], result["errors"][FAIL_AT]
        assert result["saved"] == {1: True, 3: True, 4: True}, (rank, result["saved"])
        assert result["steps"] == [3, 4], (rank, result["steps"])
        assert result["restored"] == 4
        assert result["w"] == torch.full((4, 3), 4.0).tolist() and result["counter"] == 4
    names = sorted(os.listdir(root))
    assert names == ["step_3", "step_4"], names  # step 2's leftovers were tidied too
