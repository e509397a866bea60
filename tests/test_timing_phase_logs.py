"""Per-phase timing logs under ``HP_LOG_CONFIG=DCP:INFO``, in the user guide's format:

    [INFO] [HP-DCP]: [rank=0] >>> func execute_write cost 0.0061 seconds
"""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

LINE = re.compile(r"^\[INFO\] \[HP-DCP\]: \[rank=(\d+)\] >>> func (\w+) cost (\d+\.\d{4}) seconds$")


def _save_and_load_logged(rank: int, world_size: int, root: str) -> dict[str, str]:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import StandardSavePlanner

    captured = io.StringIO()
    sys.stderr = captured  # the DCP log handler is created on first use, on this stream
    sd = {"w": torch.full((4, 4), float(rank)), "step": 1}
    dcp.save(sd, checkpoint_id=root, planner=StandardSavePlanner(enable_plan_caching=False))
    save_log = captured.getvalue()
    target = {"w": torch.zeros(4, 4), "step": None}
    dcp.load(target, checkpoint_id=root)
    sys.stderr = sys.__stderr__
    return {"save": save_log, "load": captured.getvalue()[len(save_log):]}


def _phases(text: str, rank: int) -> list[str]:
    names = []
    for line in text.splitlines():
        match = LINE.match(line)
        assert match, f"not in the guide's format: {line!r}"
        assert int(match.group(1)) == rank, line
        assert 0.0 <= float(match.group(3)) < 120.0, line
        names.append(match.group(2))
    return names


@pytest.mark.distributed
def test_every_phase_logs_one_line_per_rank_in_the_guide_format(tmp_path):
    results = run_distributed(_save_and_load_logged, 2, str(tmp_path / "ckpt"), timeout=240,
                              env={"HP_LOG_CONFIG": "DCP:INFO"})
    for rank, logs in enumerate(results):
        save = _phases(logs["save"], rank)
        load = _phases(logs["load"], rank)
        for phase in ("save", "_save_impl", "build_local_plan", "execute_write"):
            assert save.count(phase) == 1, (rank, phase, save)
        # global planning and the commit happen on the coordinator only
        assert save.count("build_global_plan") == save.count("finalize_checkpoint") == (1 if rank == 0 else 0)
        # the coordinator builds the metadata while every rank waits for its own fsyncs
        assert save.count("prepare_metadata") == (1 if rank == 0 else 0) and save.count("sync_written") == 1
        # ... having built it in the global plan, before its own write, and attached the results after
        assert save.count("build_global_plan") == (1 if rank == 0 else 0), (rank, save)
        assert rank != 0 or save.index("build_global_plan") < save.index("execute_write") < save.index(
            "prepare_metadata"), save
        assert rank != 0 or save.index("prepare_metadata") < save.index("sync_written") < save.index(
            "finalize_checkpoint"), save
        assert save[-1] == "save"  # the outer phase closes last
        for phase in ("load", "read_metadata", "parse_metadata", "build_local_plan", "execute_read"):
            assert load.count(phase) == 1, (rank, phase, load)
        # reader assignment runs on the coordinator alone: the others send their targets
        # (gather) and receive their own part (scatter); the metadata is read once and broadcast
        assert load.count("build_global_plan") == (1 if rank == 0 else 0), (rank, load)
        assert "gather_object" in load and "scatter_object" in load and "broadcast_object" in load
        assert load[-1] == "load"


def test_no_log_lines_without_hp_log_config(tmp_path, monkeypatch, capfd):
    import hyper_parallel_dcp as dcp

    monkeypatch.delenv("HP_LOG_CONFIG", raising=False)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "quiet", no_dist=True)
    dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "quiet", no_dist=True)
    assert "[HP-DCP]" not in capfd.readouterr().err
