"""A test hook: a process SIGKILLs itself at a named phase (:func:`fault_point`), or a write fails
with ``ENOSPC`` (:func:`fault_error`), when ``HP_DCP_FAULT=<phase>[@<rank>][,...]`` names it;
with ``HP_DCP_FAULT_ONCE=<file>`` only the first process to get there dies.  Phases: :data:`PHASES`.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .settings import FAULT, FAULT_ONCE

__all__ = ["PHASES", "fault_error", "fault_point"]

PHASES = ("save.setup", "save.plan", "save.write", "save.commit",
          "load.setup", "load.plan", "load.read", "load.broadcast", "local.write", "local.replicate", "local.full")


def _named(phase: str, rank: int) -> bool:
    spec = FAULT.get()
    entries = (entry.strip().partition("@") for entry in spec.split(",") if spec)
    return any(name == phase and (not who or int(who) == rank) for name, _, who in entries)


def fault_error(phase: str, rank: int) -> None:
    """Raise ``OSError(ENOSPC)`` here if ``HP_DCP_FAULT`` names ``phase`` for ``rank`` (a full disk)."""
    if _named(phase, rank):
        raise OSError(errno.ENOSPC, f"No space left on device (injected by HP_DCP_FAULT={FAULT.get()})")


def fault_point(phase: str, rank: int) -> None:
    """Die here if ``HP_DCP_FAULT`` names ``phase`` for ``rank`` (see the module doc)."""
    if _named(phase, rank):
        once = FAULT_ONCE.get()
        if once:
            try:
                fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return
            os.write(fd, repr(time.time()).encode())  # when it fired: time-to-surface is measured from here
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
