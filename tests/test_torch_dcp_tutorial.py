"""torch's DCP tutorial (FSDP2 + a Stateful ``AppState``) with only its import changed,
launched with ``torchrun``: the resumed run's next loss equals the uninterrupted one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "assets" / "torch_dcp_tutorial.py"


def _torchrun(mode: str, ckpt: Path, tmp: Path) -> float:
    # 2 CPU ranks (gloo): on a machine with one GPU, fully_shard's default mesh would put
    # both ranks on CUDA devices 0 and 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(SCRIPT), mode, str(ckpt)]
    # No retry: a rank that aborted at exit (docs/faults.md) is a failure since core.exit_drain.
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return float(re.search(r"LOSS (\S+)", out.stdout).group(1))


def test_tutorial_script_with_only_the_import_changed_resumes_to_the_same_loss(tmp_path):
    text = SCRIPT.read_text()
    assert "import hyper_parallel_dcp as dcp  # was: import torch.distributed.checkpoint as dcp" in text
    ckpt = tmp_path / "checkpoint"
    uninterrupted = _torchrun("save", ckpt, tmp_path)
    assert (ckpt / ".metadata").read_bytes()[:1] == b"{"
    resumed = _torchrun("load", ckpt, tmp_path)
    assert resumed == uninterrupted
