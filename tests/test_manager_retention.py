"""CheckpointManager in one process: the retention rules, bad input, user files, ls/clean/latest.

The expected set of steps after each save comes from an independent reference (a plain
re-statement of §10's rule over the steps saved so far), not from the code under test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp import CheckpointManager
from hyper_parallel_dcp.cli import main as cli_main
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, UnsupportedTensorError
from hyper_parallel_dcp.retention import best_steps, steps_to_delete


def reference_kept(saved: list[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    """§10 by hand: after each save, delete what is neither among the newest keep_last nor a
    multiple of keep_every (the newest always stays); deleted steps stay deleted."""
    alive: list[int] = []
    for step in saved:
        alive = sorted(set(alive) | {step})
        if keep_last is None:
            continue
        newest = alive[-keep_last:]
        alive = [s for s in alive if s in newest or (keep_every and s % keep_every == 0) or s == alive[-1]]
    return alive


def _state(step: int) -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step, "meta": {"step": step, "tag": f"s{step}"}}


def _check_state(sd: dict, step: int) -> None:
    assert torch.equal(sd["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4) + step)
    assert sd["meta"] == {"step": step, "tag": f"s{step}"}


def _names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


# ------------------------------------------------------------------ pure retention
@pytest.mark.parametrize("complete, keep_last, keep_every, protected, expected", [
    ([1, 2, 3, 4, 5], 2, None, (), [1, 2, 3]),
    ([1, 2, 3, 4, 5], 2, 2, (), [1, 3]),
    ([4, 8, 9, 10, 11], 2, 4, (), [9]),
    ([1, 2, 3], None, None, (), []),
    ([1, 2, 3], 1, None, (1,), [2]),
    ([5], 1, None, (), []),
    ([], 1, None, (), []),
    ([0, 3, 6, 7], 1, 3, (), []),  # 0 is a multiple of every period
    ([10, 2, 7], 1, None, (), [2, 7]),  # unordered input
])
def test_steps_to_delete_table(complete, keep_last, keep_every, protected, expected) -> None:
    assert steps_to_delete(complete, keep_last=keep_last, keep_every=keep_every,
                           protected=frozenset(protected)) == expected


def test_best_steps_min_max_and_ties() -> None:
    metric = {1: 0.5, 2: 0.3, 3: 0.9, 4: 0.3}
    assert best_steps(metric, 1, "min") == {4}  # a tie goes to the newer step
    assert best_steps(metric, 2, "min") == {2, 4}
    assert best_steps(metric, 1, "max") == {3}
    assert best_steps({}, 2, "min") == set()


# ------------------------------------------------------------------ the manager, one process
def test_ten_steps_keep_last_2_keep_every_4(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "my_notes").mkdir(parents=True)
    (root / "my_notes" / "a.txt").write_text("mine")
    (root / "config.yaml").write_text("lr: 1")
    (root / "step_007").mkdir()  # not a step of the manager (not str(7))
    saved = []
    with CheckpointManager(root, keep_last=2, keep_every=4) as mgr:
        for step in range(1, 11):
            assert mgr.save(step, _state(step)) is True
            saved.append(step)
            assert mgr.all_steps() == reference_kept(saved, 2, 4), step
        assert mgr.latest_step() == 10
    assert _names(root) == ["config.yaml", "my_notes", "step_007", "step_10", "step_4", "step_8", "step_9"]
    assert (root / "my_notes" / "a.txt").read_text() == "mine"
    for step in (4, 8, 9, 10):
        sd = _state(0)
        with CheckpointManager(root) as mgr:
            assert mgr.restore(sd, step=step) == step
        _check_state(sd, step)


def test_interval_force_and_keep_all(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, save_interval_steps=3) as mgr:
        done = [s for s in range(0, 10) if mgr.save(s, _state(s))]
        assert done == [0, 3, 6, 9]
        assert mgr.save(4, _state(4), force=True) is True
        assert mgr.all_steps() == [0, 3, 4, 6, 9]
        sd = _state(-1)
        assert mgr.restore(sd) == 9
        _check_state(sd, 9)


def test_resave_replaces_and_restore_newest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save(5, _state(5))
        mgr.save(5, _state(50))  # the same step again: replaced
        assert mgr.all_steps() == [5]
        sd = _state(0)
        assert mgr.restore(sd) == 5
        _check_state(sd, 50)


def test_missing_root_is_empty_and_restore_returns_none(tmp_path: Path) -> None:
    root = tmp_path / "not" / "yet"
    mgr = CheckpointManager(root)
    assert mgr.latest_step() is None and mgr.all_steps() == []
    sd = _state(3)
    assert mgr.restore(sd) is None
    _check_state(sd, 3)  # untouched
    assert not root.exists()
    with pytest.raises(CheckpointNotFoundError, match="step 4"):
        mgr.restore(sd, step=4)
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, sd)


@pytest.mark.parametrize("kwargs, match", [
    ({"keep_last": 0}, "keep_last"),
    ({"keep_last": -2}, "keep_last"),
    ({"keep_last": True}, "keep_last"),
    ({"keep_every": 0}, "keep_every"),
    ({"save_interval_steps": 0}, "save_interval_steps"),
    ({"save_interval_steps": None}, "save_interval_steps"),
    ({"keep_best": 2}, "best_metric"),
    ({"keep_best": 2, "best_metric": "loss", "best_mode": "lowest"}, "best_mode"),
])
def test_bad_settings(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointManager(tmp_path, **kwargs)


def test_bad_steps_and_root_that_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(afile)):
        CheckpointManager(afile)
    assert afile.read_text() == "x"
    with CheckpointManager(tmp_path / "r") as mgr:
        for bad in (-1, 1.5, "3", None, True):
            with pytest.raises(ValueError, match="step"):
                mgr.save(bad, _state(1))
        with pytest.raises(ValueError, match="step"):
            mgr.restore(_state(1), step=-3)
        with pytest.raises(ValueError, match="metric"):
            mgr.save(1, _state(1), metrics={"loss": [1, 2]})
        assert mgr.all_steps() == []
    with pytest.raises(ValueError, match="gopher://"):  # a scheme no installed package handles
        CheckpointManager("gopher://bucket/prefix")


def test_step_dir_without_metadata_among_complete_ones(tmp_path: Path) -> None:
    root = tmp_path
    with CheckpointManager(root, keep_last=3) as mgr:
        mgr.save(1, _state(1))
        mgr.save(3, _state(3))
        # an interrupted save of step 2 (only checkpoint files) and a hand-made step_4 with notes
        (root / "step_2").mkdir()
        (root / "step_2" / "_rank0_.safetensors.hp-dcp-tmp").write_bytes(b"\0" * 100)
        (root / "step_2" / "LOCAL_PLAN_1.pkl").write_bytes(b"x")
        (root / "step_4").mkdir()
        (root / "step_4" / "notes.txt").write_text("mine")
        from hyper_parallel_dcp import save

        save(_state(0), checkpoint_id=root / "step_0", no_dist=True)  # a rank-local save of the user's:
        (root / "step_0" / ".metadata").rename(root / "step_0" / "0.metadata")  # loadable, not ours
        assert mgr.all_steps() == [1, 3]
        sd = _state(0)
        assert mgr.restore(sd) == 3  # never the directory without .metadata
        _check_state(sd, 3)
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            mgr.restore(sd, step=2)
        mgr.save(5, _state(5))  # a newer complete step: the step directories without .metadata go
        assert mgr.all_steps() == [1, 3, 5]
    assert not (root / "step_2").exists()
    assert not (root / "step_4").exists()  # step_N is the manager's name, whatever it holds (SPEC §10)
    assert (root / "step_0" / "0.metadata").is_file()


def test_broken_newest_is_skipped_by_restore(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    (tmp_path / "step_2" / "_rank0_.safetensors").unlink()  # someone deleted a data file
    sd = _state(0)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(sd) == 1
    _check_state(sd, 1)


def test_metrics_and_keep_best(tmp_path: Path) -> None:
    losses = {1: 0.9, 2: 0.2, 3: 0.7, 4: 0.5, 5: 0.8, 6: 0.6}
    with CheckpointManager(tmp_path, keep_last=2, keep_best=1, best_metric="loss") as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": torch.tensor(loss), "lr": 1e-3, "note": "ok"})
        assert mgr.all_steps() == [2, 5, 6]
        assert mgr.metrics(2) == {"loss": pytest.approx(0.2), "lr": 1e-3, "note": "ok"}
    with CheckpointManager(tmp_path, keep_last=1, keep_best=2, best_metric="acc", best_mode="max") as mgr:
        mgr.save(7, _state(7), metrics={"acc": 0.1})
        # steps 2, 5, 6 have no "acc": only keep_last and the best by acc apply
        assert mgr.all_steps() == [7]


def test_preemption_save_single_process(tmp_path: Path) -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path, save_interval_steps=100, save_on_preemption=True) as mgr:
        assert mgr.save(1, _state(1)) is False
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
        assert mgr.save(2, _state(2)) is True
        assert mgr.preempted and mgr.all_steps() == [2]
        assert mgr.save(3, _state(3)) is False
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------ the command line
def test_latest_counts_only_step_dirs_on_a_manager_root(tmp_path: Path, capsys) -> None:
    from hyper_parallel_dcp import save

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, _state(3))
    save(_state(4), checkpoint_id=tmp_path / "fsdp4", no_dist=True)  # a sibling run, not step 4
    assert cli_main(["latest", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "step_3")


def test_ls_and_clean(tmp_path: Path, capsys) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.5})
        mgr.save(2, _state(2), metrics={"loss": 0.25})
    (tmp_path / "step_1" / ".hp-dcp-mailbox-ack-1.pkl").write_bytes(b"x" * 10)
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "LOCAL_PLAN_0.pkl").write_bytes(b"x" * 7)
    (tmp_path / ".step_0.hp-dcp-staging-dead").mkdir()
    (tmp_path / ".step_0.hp-dcp-staging-dead" / "_rank0_.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".step_0.hp-dcp-lock").write_text("{}")
    (tmp_path / "user.txt").write_text("mine")

    assert cli_main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["complete"]) for s in doc["steps"]] == [(1, True), (2, True), (3, False)]
    assert doc["latest"] == 2
    assert doc["steps"][1]["metrics"] == {"loss": 0.25}
    assert doc["steps"][0]["bytes"] == sum(p.stat().st_size for p in (tmp_path / "step_1").iterdir())
    assert doc["steps"][0]["age_s"] >= 0
    assert cli_main(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "loss=0.25" in text and "latest complete: step 2" in text

    # step_3 is newer than the newest complete: a save that may still come, kept
    assert cli_main(["clean", str(tmp_path), "--grace", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted((x["kind"], x["step"]) for x in doc["removed"]) == [("lock", 0), ("mailbox", 1), ("staging", 0)]
    assert doc["bytes"] == 1010
    assert _names(tmp_path) == ["step_1", "step_2", "step_3", "user.txt"]
    assert ".hp-dcp-mailbox-ack-1.pkl" not in os.listdir(tmp_path / "step_1")
    sd = _state(0)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(sd, step=1) == 1
    _check_state(sd, 1)
    assert cli_main(["clean", str(tmp_path / "user.txt")]) == 2


def test_clean_never_touches_a_running_save(tmp_path: Path, capsys) -> None:
    from hyper_parallel_dcp.storage_fs.commit import SaveLock

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, _state(5))
    staging = tmp_path / ".step_3.hp-dcp-staging-live"
    staging.mkdir()
    (staging / "_rank0_.safetensors.hp-dcp-tmp").write_bytes(b"x")
    lock = SaveLock(tmp_path / "step_3")  # a save of step 3 holds its lock
    lock.acquire()
    try:
        assert cli_main(["clean", str(tmp_path), "--grace", "0"]) == 0
        assert staging.is_dir() and (tmp_path / ".step_3.hp-dcp-lock").exists()
    finally:
        lock.release()
    capsys.readouterr()
    assert cli_main(["clean", str(tmp_path)]) == 0  # default grace: just modified, still kept
    assert staging.is_dir()
    assert cli_main(["clean", str(tmp_path), "--grace", "0"]) == 0
    assert not staging.exists()


def test_retention_never_deletes_a_step_being_read(tmp_path: Path) -> None:
    from hyper_parallel_dcp.step_storage import FileSystemSteps

    steps = FileSystemSteps(tmp_path)
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, _state(1))
        with steps.reading(1):  # e.g. an evaluation job restoring step 1 from this root
            mgr.save(2, _state(2))
            assert mgr.all_steps() == [1, 2]
            sd = _state(0)
            other = CheckpointManager(tmp_path)
            assert other.restore(sd, step=1) == 1  # readers share the lock
            _check_state(sd, 1)
        mgr.save(3, _state(3))
        assert mgr.all_steps() == [3]
    assert _names(tmp_path) == ["step_3"]  # no lock files left behind


def test_async_error_surfaces_once_in_the_next_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, async_save=True) as mgr:
        # staged fine, but the writer process cannot receive a lambda: the save fails in flight
        mgr.save(1, {"w": torch.ones(4), "fn": lambda: 0})
        with pytest.raises(Exception, match="(?i)pickl|lambda"):
            mgr.save(2, {"w": torch.full((4,), 2.0)})
        assert mgr.all_steps() == []  # step 2 was not saved by the call that raised
        assert mgr.save(3, {"w": torch.full((4,), 3.0)}) is True  # raised once only
        mgr.wait()
        assert mgr.all_steps() == [3]
        sd = {"w": torch.zeros(4)}
        assert mgr.restore(sd) == 3 and torch.equal(sd["w"], torch.full((4,), 3.0))
    assert not (tmp_path / "step_1" / ".metadata").exists()


def test_async_staging_error_is_raised_and_the_next_save_works(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        with pytest.raises(UnsupportedTensorError, match="meta device"):
            mgr.save(2, {"w": torch.empty(4, device="meta")})  # fails while staging, in the caller
        assert mgr.save(3, {"w": torch.full((4,), 3.0)})
        mgr.wait()
        assert mgr.all_steps() == [1, 3]
