"""``tools/train_resume_check.py`` on CPU: the trainer's loop the GPU sessions run, killed at
step 13 and resumed by torchrun, ends bit-identical to the uninterrupted run (one rank:
torch's gloo set-up of a restarted attempt with two ranks is flaky on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_killed_and_resumed_loop_ends_equal_to_the_uninterrupted_one():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_resume_check.py"), "--device", "cpu", "--nproc", "1"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 0, attempt 1] restored step 12 onto cpu" in proc.stdout
    assert "[rank 0, attempt 1] trained steps 13-20" in proc.stdout
    assert "bit-identical to the reference's; kept ['step_15', 'step_18']" in proc.stdout
