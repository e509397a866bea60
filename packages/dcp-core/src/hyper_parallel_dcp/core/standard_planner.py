"""The default planners, re-exported from the modules that hold them by concern.

* :mod:`.save_planning` — local write items, dedup across ranks, metadata build,
  :class:`StandardSavePlanner`;
* :mod:`.plan_cache` — the plan cache the save planner uses;
* :mod:`.load_planning` — local read items, :class:`StandardLoadPlanner`;
* :mod:`.reader_assignment` — replica groups and one reader per replicated shard.
"""

from __future__ import annotations

from .load_planning import StandardLoadPlanner, create_local_load_plan
from .reader_assignment import assign_readers
from .save_planning import StandardSavePlanner, build_metadata, create_local_save_plan, dedup_save_plans

__all__ = [
    "StandardLoadPlanner",
    "StandardSavePlanner",
    "assign_readers",
    "build_metadata",
    "create_local_load_plan",
    "create_local_save_plan",
    "dedup_save_plans",
]
