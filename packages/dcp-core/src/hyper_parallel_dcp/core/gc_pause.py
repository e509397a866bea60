"""Pausing the cyclic garbage collector around planning."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (re-enabled after, unless it was off before).

    Global planning allocates millions of small acyclic objects while millions of gathered
    plan items are alive, so full collections keep re-traversing them: at 8192 simulated
    MoE ranks they were 2.2 of 5.4 CPU seconds of dedup + metadata build.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
