"""A test hook: a process kills itself (SIGKILL) at a named checkpoint phase.

Used by the fault-injection tests and the soak benchmark; inert unless
``HP_DCP_FAULT`` is set.  ``HP_DCP_FAULT=<phase>@<rank>`` (several separated by commas;
``@<rank>`` may be left out for every rank) kills the process that reaches
:func:`fault_point` with that phase and rank.  With ``HP_DCP_FAULT_ONCE=<file>`` only the
first process to get there dies (it creates the file and writes the time it fired into
it), so a restarted writer or the next save go through.

Phases: :data:`PHASES` (``save.commit``: on the coordinator just before ``.metadata`` is
written, elsewhere after its own files are); an async save's writer process dies there.
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
