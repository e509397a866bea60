"""Pausing the cyclic garbage collector around planning."""

from __future__ import annotations

import contextlib
import gc
import sysconfig
from typing import Iterator

__all__ = ["gc_paused"]

# A free-threaded build freezes by visiting every object of the heap: no cheap promotion.
_PROMOTE = not sysconfig.get_config_var("Py_GIL_DISABLED")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (re-enabled after, unless it was off); on the way out what
    the block still holds joins the oldest generation without a traversal (freeze + unfreeze)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if _PROMOTE and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
