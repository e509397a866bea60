"""``tools/accelerator_check.py`` runs where no GPU is: ``--device cpu`` takes every path
the GPU run takes (sync save, first and later async saves, loads, the 2-rank read-once +
broadcast load) and compares every loaded value with what was saved, so that the script a
GPU session gets a few minutes to run has not rotted in between.  The report puts each
figure beside its reference of the same run, with their ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_accelerator_check_runs_on_cpu_and_reports_every_figure(tmp_path):
    out = tmp_path / "accelerator.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "accelerator_check.py"), "--device", "cpu", "--size-mib", "8",
         "--small", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["device"] == "cpu"
    # 8 MiB of 4096 x 4096 bf16 matrices is none: the dense part is at least one matrix
    assert report["tensors"] >= 20 and report["bytes"] >= 20 * 4096
    for figure in ("async_first_blocking_s", "async_first_landed_s", "async_later_blocking_s",
                   "async_later_landed_s", "save_s", "load_s", "load_async_s", "broadcast_load_2ranks_s",
                   "fresh_copy_s", "raw_write_s", "raw_read_s"):
        assert report[figure] > 0, figure
    text = out.read_text()
    assert "every loaded value compared with what was saved" in text
    assert f"torch {torch.__version__}" in report["environment"] and report["environment"] in text
    # each figure beside its reference of the same run, and their ratio
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    for row, reference, figure, ref_figure in (
            ("async_save blocking, first save", "a fresh host copy of every tensor", "async_first_blocking_s",
             "fresh_copy_s"),
            ("async_save until landed, later (median of 3)", "raw write + fsync", "async_later_landed_s", "raw_write_s"),
            ("save (sync)", "raw write + fsync", "save_s", "raw_write_s"),
            ("load into device tensors (page cache warm)", "raw read into pinned host", "load_s", "raw_read_s"),
            ("load async into device tensors (page cache warm)", "raw read into pinned host", "load_async_s",
             "raw_read_s")):
        assert reference in rows[row], row
        assert f"| {report[figure] / report[ref_figure]:.2f}× |" in rows[row], row
    assert "one memory copy" in rows["async_save blocking, later save (median of 3)"]
    later = report["async_later_blocking_all_s"]
    assert len(later) == 3 and report["async_later_blocking_s"] == sorted(later)[1]
    assert "Replicated load, 2 ranks, read once + broadcast" in text
