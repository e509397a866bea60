"""When CheckpointManager's retention runs, seen as a trainer sees it (docs/training-loop.md,
"When retention runs"): an async job that exits without ``close()`` leaves ``keep_last + 1``
steps, which the next job's first save tidies; going back to an older step is warned about.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp import CheckpointManager

_NO_CLOSE_JOB = textwrap.dedent("""
    import sys, torch
    from hyper_parallel_dcp import CheckpointManager

    if __name__ == "__main__":  # the async writer is started with "spawn"
        mgr = CheckpointManager(sys.argv[1], keep_last=2, async_save=True)
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        # no wait(), no close(): the interpreter's exit lands step 4, nobody runs its retention
""")


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def test_async_job_exiting_without_close_leaves_one_more_and_the_next_job_tidies(tmp_path: Path) -> None:
    root = tmp_path / "run"
    script = tmp_path / "job.py"
    script.write_text(_NO_CLOSE_JOB)
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(root) == [2, 3, 4]  # step 4 landed at exit; the retention of step 3 ran in save(4)
    assert all((root / f"step_{s}" / ".metadata").is_file() for s in (2, 3, 4))

    with CheckpointManager(root, keep_last=2, async_save=True) as mgr:
        sd = {"w": torch.zeros(4)}
        assert mgr.restore(sd) == 4 and torch.equal(sd["w"], torch.full((4,), 4.0))
        mgr.save(5, {"w": torch.full((4,), 5.0)})
        # the first save of a job applies the retention left over, while step 5 is in flight
        assert 2 not in _steps(root) and {3, 4} <= set(_steps(root))
        mgr.wait()
        assert mgr.all_steps() == [4, 5]
    assert _steps(root) == [4, 5]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_going_back_to_an_older_step_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     use_async: bool) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=4, async_save=use_async) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"w": torch.full((2,), float(step))})
        mgr.wait()
        assert mgr.all_steps() == [4, 8, 9, 10]
        sd = {"w": torch.zeros(2)}
        assert mgr.restore(sd, step=4) == 4
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp.manager"):
            mgr.save(5, {"w": torch.full((2,), 105.0)})
            mgr.wait()
        # documented: retention and restore go by step number, so the new step 5 is deleted
        assert mgr.all_steps() == [4, 8, 9, 10]
        warned = [r.getMessage() for r in caplog.records if "newer step(s)" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert "step 5 was just saved" in warned[0] and "[8, 9, 10]" in warned[0]
        assert "retention deletes it now" in warned[0]

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp.manager"):
            mgr.save(11, {"w": torch.full((2,), 11.0)})  # moving forward again: no warning
            mgr.wait()
        assert not [r for r in caplog.records if "newer step(s)" in r.getMessage()]
        assert mgr.all_steps() == [4, 8, 10, 11]


def test_an_async_step_that_landed_before_the_previous_retention_is_not_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # save(N) runs step N-2's retention while step N is in flight; a fast writer has landed
    # step N by then, and it is this job's own step, not a newer one from an abandoned run
    import hyper_parallel_dcp.async_persist as async_persist

    real = async_persist.async_save

    def landed_at_once(*args: object, **kwargs: object) -> object:
        response = real(*args, **kwargs)
        response.get_result(timeout=120)
        return response

    monkeypatch.setattr(async_persist, "async_save", landed_at_once)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp.manager"):
        with CheckpointManager(tmp_path, keep_last=2, async_save=True) as mgr:
            for step in range(1, 5):
                mgr.save(step, {"w": torch.full((2,), float(step))})
                assert step in _steps(tmp_path)  # landed before save() returned
    assert not [r.getMessage() for r in caplog.records if "newer step(s)" in r.getMessage()]
    assert _steps(tmp_path) == [3, 4]
