"""A test hook: a process kills itself (SIGKILL) at a named checkpoint phase.

Inert unless ``HP_DCP_FAULT=<phase>@<rank>[,...]`` is set (``@<rank>`` left out: every
rank); with ``HP_DCP_FAULT_ONCE=<file>`` only the first process to get there dies (it
creates the file).  Phases: :data:`PHASES` (``save.commit``: on the coordinator just
before ``.metadata`` is written, elsewhere after its own files are).
"""

from __future__ import annotations

import os
import signal
import time

from .settings import FAULT, FAULT_ONCE

__all__ = ["PHASES", "fault_point"]

PHASES = ("save.setup", "save.plan", "save.write", "save.commit",
          "load.setup", "load.plan", "load.read", "load.broadcast")


def fault_point(phase: str, rank: int) -> None:
    """Die here if ``HP_DCP_FAULT`` names ``phase`` for ``rank`` (see the module doc)."""
    spec = FAULT.get()
    if not spec:
        return
    for entry in spec.split(","):
        name, _, who = entry.strip().partition("@")
        if name != phase or (who and int(who) != rank):
            continue
        once = FAULT_ONCE.get()
        if once:
            try:
                fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return
            os.write(fd, repr(time.time()).encode())  # when it fired: time-to-surface is measured from here
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
