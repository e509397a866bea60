"""Let gloo's worker threads finish before the interpreter shuts down (else ``SIGABRT``, see
``docs/faults.md``): :func:`install` registers :func:`drain_collective_threads` at exit."""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Optional

__all__ = ["DRAIN_LIMIT_S", "drain_collective_threads", "install", "runnable_threads"]

#: At most this long at interpreter exit (seconds).
DRAIN_LIMIT_S = 0.2
# one waiting thread takes the GIL per pause: a few quiet looks in a row also cover
# gloo's two workers and a transport thread waking at once
_PAUSE_S = 0.001
_QUIET_LOOKS = 3

_installed = False
_install_lock = threading.Lock()


def runnable_threads(exclude: int) -> Optional[int]:
    """How many threads of this process, other than native id ``exclude``, are running or
    runnable (state ``R`` in ``/proc/self/task``); ``None`` where that cannot be read."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    return sum(_state(tid) == b"R" for tid in tids if tid != str(exclude))


def _state(tid: str) -> bytes:
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return b""  # that thread has just ended
    # "tid (name) S ...": the name may hold spaces and parentheses, the state follows the last ")"
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]


def drain_collective_threads(limit: float = DRAIN_LIMIT_S) -> bool:
    """Hand the GIL over until no other thread runs, at most ``limit`` seconds; returns whether
    the process went quiet."""
    me = threading.get_native_id()
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < _QUIET_LOOKS:
        time.sleep(_PAUSE_S)  # releases the GIL
        busy = runnable_threads(me)
        quiet = quiet + 1 if not busy else 0
        if busy is not None and time.monotonic() > deadline:
            return quiet >= _QUIET_LOOKS
    return True


def _at_exit() -> None:
    try:
        # also after destroy_process_group(): a group a device mesh still references keeps its workers
        drain_collective_threads()
    except Exception:  # noqa: BLE001 - never turn a clean exit into a failed one
        pass


def install() -> None:
    """Register :func:`drain_collective_threads` to run at interpreter exit, once per process."""
    global _installed
    with _install_lock:
        if not _installed:
            atexit.register(_at_exit)
            _installed = True
