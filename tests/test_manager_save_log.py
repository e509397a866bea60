"""One INFO line per save from ``CheckpointManager`` (its own logger): the step, the bytes,
the seconds, and whether the checkpoint landed (sync) or was staged (async)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import hyper_parallel_dcp as dcp

_LOGGER = "hyper_parallel_dcp.manager"


def _lines(caplog: pytest.LogCaptureFixture, step: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == _LOGGER and r.levelno == logging.INFO and f"step {step} " in r.getMessage()]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_one_info_line_per_save_with_step_bytes_seconds_and_state(tmp_path, caplog, use_async):
    sd = {"w": torch.ones(256, 256), "step": 0}  # 256 KiB of tensor data
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        with dcp.CheckpointManager(tmp_path, async_save=use_async, save_interval_steps=2) as mgr:
            assert not mgr.save(1, sd)  # not a saving step: no line
            assert mgr.save(2, sd)
            mgr.wait()
    assert _lines(caplog, 1) == []
    (line,) = _lines(caplog, 2)
    assert str(tmp_path / "step_2") in line
    assert re.search(r" in \d+\.\d{3} s", line), line
    nbytes = int(re.search(r"\((\d+) bytes\)", line).group(1))
    if use_async:
        assert "staged" in line and nbytes == 256 * 256 * 4, line  # this rank's host copy
    else:
        written = sum(p.stat().st_size for p in (tmp_path / "step_2").iterdir() if p.name.startswith("_rank"))
        assert "landed" in line and nbytes == written, line  # every file of the checkpoint
