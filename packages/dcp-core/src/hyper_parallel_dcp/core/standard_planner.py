"""The default planners and planning functions, re-exported from :mod:`.save_planning`,
:mod:`.load_planning` and :mod:`.reader_assignment`."""

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
