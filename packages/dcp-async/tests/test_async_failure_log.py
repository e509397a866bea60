"""An async save that fails in one process without a process group says where, not a rank."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from hyper_parallel_dcp.async_persist import async_save, persist


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_failed_async_save_without_a_group_names_no_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # the checkpoint directory cannot be made under a file
    target = blocker / "step_1"
    seen = _Lines()
    persist.logger.addHandler(seen)
    try:
        future = async_save({"w": torch.ones(4)}, checkpoint_id=str(target), no_dist=True)
        with pytest.raises(FileExistsError):
            future.get_result(timeout=120)
    finally:
        persist.logger.removeHandler(seen)
    assert len(seen.lines) == 1, seen.lines
    expected = rf"async_save #\d+ into {re.escape(str(target))} failed: FileExistsError: .*{re.escape(str(blocker))}'"
    assert re.fullmatch(expected, seen.lines[0]), seen.lines
