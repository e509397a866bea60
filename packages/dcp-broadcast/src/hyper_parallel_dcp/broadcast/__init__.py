"""Read-once + broadcast loading of replicated shards: :func:`make_read_executor` builds the
executor ``load(..., broadcast_replicated_tensors=True)`` hands to the load pipeline."""

from .__about__ import __version__
from .executor import DEFAULT_BATCH_BYTES, MAX_IN_FLIGHT, BroadcastReadExecutor, BroadcastStats, make_read_executor
from .groups import broadcast_groups_for_load
from .prefetch import ReadAhead
from .schedule import plan_broadcasts, rank_schedule, required_groups

__all__ = ["DEFAULT_BATCH_BYTES", "MAX_IN_FLIGHT", "BroadcastReadExecutor", "BroadcastStats", "ReadAhead",
           "__version__", "broadcast_groups_for_load", "make_read_executor", "plan_broadcasts", "rank_schedule",
           "required_groups"]
