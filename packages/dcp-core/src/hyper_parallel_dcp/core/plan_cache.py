"""The save-plan cache: final plans (and the coordinator's metadata) kept between saves.

One process-wide :class:`PlanCache` (``StandardSavePlanner.plan_cache``); the async writer
mirrors entries into its writer process with :meth:`PlanCache.export` / :meth:`PlanCache.install`.
"""

from __future__ import annotations

import threading
from typing import Hashable, Optional

from .metadata import Metadata
from .planner import SavePlan

__all__ = ["CachedPlan", "PlanCache", "PlanCacheEntry"]

# (final plan, metadata on the coordinator or None, layout fingerprint of the state dict)
CachedPlan = tuple[SavePlan, Optional[Metadata], tuple]
# (key, cached plan or None for "no entry"): what crosses a process boundary
PlanCacheEntry = tuple[Hashable, Optional[CachedPlan]]


class PlanCache:
    """A thread-safe map from a planner's cache key to a :data:`CachedPlan`."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, CachedPlan] = {}
        self._lock = threading.Lock()

    def lookup(self, key: Hashable) -> Optional[CachedPlan]:
        """The entry stored under ``key``, or ``None``."""
        with self._lock:
            return self._entries.get(key)

    def store(self, key: Hashable, value: CachedPlan) -> None:
        """Store (or replace) the entry under ``key``."""
        with self._lock:
            self._entries[key] = value

    def export(self, key: Hashable) -> PlanCacheEntry:
        """``(key, entry or None)``: this process's state for ``key``, to send elsewhere."""
        return key, self.lookup(key)

    def install(self, entry: PlanCacheEntry) -> None:
        """Make this cache agree with an exported entry (``None`` removes the key)."""
        key, value = entry
        with self._lock:
            if value is None:
                self._entries.pop(key, None)
            else:
                self._entries[key] = value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()


