"""What ``hp-dcp-convert`` prints: summaries that count tensors (not the blocks they were
written in), and the per-phase timing lines in the user guide's format."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import torch

from hyper_parallel_dcp.offline_transform.cli import main

_TENSORS = {"a": torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256), "b": torch.ones(300),
            "c": torch.zeros(8, 8, dtype=torch.bfloat16)}


def test_torch_dcp_summaries_count_tensors_not_blocks(tmp_path, capsys):
    import torch.distributed.checkpoint as tdcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({**_TENSORS, "step": 4}, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    # 1 KiB blocks: "a" (64 KiB) is written in 64 of them
    assert main(["torch-dcp-to-dcp", str(tmp_path / "torch"), str(tmp_path / "ours"), "--batch-size", "1KiB"]) == 0
    assert "torch-dcp-to-dcp: 3 tensors, 1 non-tensor entries," in capsys.readouterr().out
    assert main(["dcp-to-torch-dcp", str(tmp_path / "ours"), str(tmp_path / "back"), "--batch-size", "1KiB"]) == 0
    assert "dcp-to-torch-dcp: 3 tensors, 1 non-tensor entries," in capsys.readouterr().out
    assert main(["dcp-to-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    assert "dcp-to-hf: 3 tensors," in capsys.readouterr().out


def test_timing_lines_are_in_the_guides_format(tmp_path):
    from hyper_parallel_dcp.offline_transform import save_state_dict_as_huggingface_format

    save_state_dict_as_huggingface_format(tmp_path / "hf", _TENSORS)
    env = {**os.environ, "HP_LOG_CONFIG": "DCP:INFO"}
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel_dcp.offline_transform", "hf-to-dcp",
                           str(tmp_path / "hf"), str(tmp_path / "dcp")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "execute_write" in line]
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"\[INFO\] \[HP-DCP\]: \[rank=0\] >>> func execute_write cost \d+\.\d{4} seconds", lines[0])
