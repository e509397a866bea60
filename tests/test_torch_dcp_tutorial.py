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


# torch 2.13's gloo backend can abort a rank as its interpreter exits, after all its work
# is done: a collective issued during backward (FSDP2's reduce-scatter) holds the
# contextvars snapshot torch's autograd stashes in thread-local state, and when the gloo
# worker thread drops the finished work after the main thread has begun finalizing, it
# cannot take the GIL and std::terminate is called (seen in a core dump: the worker in
# ~AsyncWork -> ~ThreadLocalState -> SafePyObject decref of a _contextvars.Context; about
# 1 run in 80 on 2 busy cores).  No checkpoint code runs then; docs/faults.md has it.
_UPSTREAM_EXIT_ABORT = "terminate called without an active exception"


def _upstream_exit_abort(out: subprocess.CompletedProcess) -> bool:
    """The run failed only by that abort: a rank died of SIGABRT with that message after
    the script printed its loss (its work was done)."""
    text = out.stdout + out.stderr
    return (out.returncode != 0 and "LOSS " in out.stdout and _UPSTREAM_EXIT_ABORT in text
            and "Signal 6 (SIGABRT)" in text)


def _torchrun(mode: str, ckpt: Path, tmp: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(SCRIPT), mode, str(ckpt)]
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if _upstream_exit_abort(out):  # once: the same run again, from the same inputs
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
