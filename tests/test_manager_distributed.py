"""CheckpointManager on real gloo ranks: training loops (sync and async), two managers in one
job, a SIGTERM on one rank, and a restore into another layout (4 ranks -> 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

ROWS, COLS = 8, 6


def reference_kept(saved: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    """§10 by hand (see test_manager_retention): what survives after each save in turn."""
    alive: list[int] = []
    for step in saved:
        alive = sorted(set(alive) | {step})
        newest = alive[-keep_last:]
        alive = [s for s in alive if s in newest or (keep_every and s % keep_every == 0) or s == alive[-1]]
    return alive


def _full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 10 + step


def _state(step: int, world_size: int, rank: int, shard_dim: int = 0, zeros: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.zeros(ROWS, COLS) if zeros else _full(step)
    return {
        "model": {"w": distribute_tensor(full, mesh, [Shard(shard_dim)])},
        "bias": torch.zeros(3) if zeros else torch.full((3,), float(step)),
        "train": {"step": -1 if zeros else step, "data_cursor": "" if zeros else f"shard-3:at-{step}"},
    }


def _check(sd: dict, step: int, rank: int) -> None:
    assert torch.equal(sd["model"]["w"].full_tensor(), _full(step)), step
    assert torch.equal(sd["bias"], torch.full((3,), float(step))), step
    assert sd["train"] == {"step": step, "data_cursor": f"shard-3:at-{step}"}, sd["train"]


def _loop_worker(rank: int, world_size: int, root: str, use_async: bool) -> dict:
    from hyper_parallel_dcp import CheckpointManager

    retentions: list[tuple[tuple[int, ...], bool]] = []
    real = CheckpointManager._apply_retention

    def spy(self, protected):
        # was the protected (in-flight) step really still being written when retention ran?
        writing = any(not os.path.exists(os.path.join(root, f"step_{s}", ".metadata")) for s in protected)
        retentions.append((tuple(sorted(protected)), writing))
        return real(self, protected)

    CheckpointManager._apply_retention = spy
    after_save = []
    mgr = CheckpointManager(root, keep_last=2, keep_every=4, async_save=use_async)
    for step in range(1, 11):
        sd = _state(step, world_size, rank)
        assert mgr.save(step, sd, metrics={"loss": 1.0 / step})
        sd["model"]["w"].to_local().fill_(-1.0)  # training goes on; a staged async save is unaffected
        after_save.append(mgr.all_steps())
    mgr.wait()
    final = mgr.all_steps()
    target = _state(0, world_size, rank, zeros=True)
    assert mgr.restore(target, step=4) == 4  # the one kept by keep_every
    _check(target, 4, rank)
    target = _state(0, world_size, rank, zeros=True)
    assert mgr.restore(target) == 10
    _check(target, 10, rank)
    mgr.close()
    return {"final": final, "after_save": after_save, "retentions": retentions if rank == 0 else None}


@pytest.mark.distributed
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_ten_step_loop_keep_last_2_keep_every_4(tmp_path: Path, use_async: bool) -> None:
    root = tmp_path / "run"
    (root / "tensorboard").mkdir(parents=True)
    (root / "tensorboard" / "events").write_text("mine")
    (root / "README").write_text("my run")
    out = run_distributed(_loop_worker, 2, str(root), use_async, timeout=240)
    expected = reference_kept(list(range(1, 11)), 2, 4)
    assert expected == [4, 8, 9, 10]
    for result in out:
        assert result["final"] == expected
    assert sorted(os.listdir(root)) == ["README", "step_10", "step_4", "step_8", "step_9", "tensorboard"]
    assert (root / "tensorboard" / "events").read_text() == "mine"
    after = out[0]["after_save"]
    retentions = out[0]["retentions"]
    if not use_async:
        assert after == [reference_kept(list(range(1, s + 1)), 2, 4) for s in range(1, 11)]
        assert [p for p, _ in retentions] == [()] * 10
    else:
        for step, steps in zip(range(1, 11), after):
            # step-1 has landed and its retention ran with `step` in flight, which may land any time
            before, now = reference_kept(list(range(1, step)), 2, 4), reference_kept(list(range(1, step + 1)), 2, 4)
            assert steps in (before, sorted(before + [step]), now), (step, steps)
        # the retention of step k ran while step k+1 was in flight (the first save's tidies up
        # while step 1 is in flight), and once more in wait()
        assert [p for p, _ in retentions] == [(s,) for s in range(1, 11)] + [()]
        assert any(writing for _, writing in retentions)


def _two_managers_worker(rank: int, world_size: int, root_a: str, root_b: str) -> dict:
    import signal

    from hyper_parallel_dcp import CheckpointManager

    a = CheckpointManager(root_a, keep_last=1)
    b = CheckpointManager(root_b, keep_last=2, save_interval_steps=100, async_save=True, save_on_preemption=True)
    saved_b = []
    for step in range(1, 7):
        a.save(step, _state(step, world_size, rank))
        if step == 4 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice reaches one rank only
        if b.save(step, _state(step + 100, world_size, rank)):
            saved_b.append(step)
        if b.preempted:
            break
    steps_a, steps_b = a.all_steps(), b.all_steps()
    target = _state(0, world_size, rank, zeros=True)
    assert a.restore(target) == 4
    _check(target, 4, rank)
    target = _state(0, world_size, rank, zeros=True)
    assert b.restore(target) == 4
    _check(target, 104, rank)
    a.close()
    b.close()
    return {"a": steps_a, "b": steps_b, "saved_b": saved_b, "preempted": b.preempted}


@pytest.mark.distributed
def test_two_managers_two_roots_and_a_sigterm_on_one_rank(tmp_path: Path) -> None:
    out = run_distributed(_two_managers_worker, 2, str(tmp_path / "a"), str(tmp_path / "b"), timeout=240)
    for result in out:
        assert result == {"a": [4], "b": [4], "saved_b": [4], "preempted": True}
    assert sorted(os.listdir(tmp_path / "a")) == ["step_4"]
    assert sorted(os.listdir(tmp_path / "b")) == ["step_4"]


def _save_on_4(rank: int, world_size: int, root: str) -> list[int]:
    from hyper_parallel_dcp import CheckpointManager

    with CheckpointManager(root, keep_last=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step, world_size, rank, shard_dim=0))
        return mgr.all_steps()


def _restore_on_2(rank: int, world_size: int, root: str) -> int | None:
    from hyper_parallel_dcp import CheckpointManager

    target = _state(0, world_size, rank, shard_dim=1, zeros=True)
    with CheckpointManager(root) as mgr:
        step = mgr.restore(target)
    assert torch.equal(target["model"]["w"].full_tensor(), _full(30))
    assert torch.equal(target["bias"], torch.full((3,), 30.0))
    assert target["train"] == {"step": 30, "data_cursor": "shard-3:at-30"}
    return step


@pytest.mark.distributed
def test_restore_into_another_layout_4_to_2(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    assert run_distributed(_save_on_4, 4, root, timeout=240) == [[20, 30]] * 4
    assert run_distributed(_restore_on_2, 2, root, timeout=240) == [30, 30]
