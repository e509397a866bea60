"""The replica groups of one load: created with ``dist.new_group``, used once, destroyed.

Group creation is a collective of *every* rank — also of ranks with no replicated shard
(a fully sharded pipeline stage): the entry condition is global, not "do I broadcast".
A rank gets the backend's non-member marker for a group it is not in; such markers are
never stored and never destroyed.  Groups are created and destroyed in rank-tuple order,
which every rank computes alike from the same global plans.  ``dist.new_group`` is used
rather than a mesh-template helper: it accepts any rank list, including a parameter tied
across non-adjacent pipeline stages (``[0, 1, 6, 7]``), and keeps no process-wide cache.
Groups the caller passes in belong to the caller: used, never destroyed.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from hyper_parallel_dcp.core.timing import phase

__all__ = ["broadcast_groups_for_load"]

logger = logging.getLogger(__name__)

RankTuple = tuple[int, ...]


def _is_member_group(group: Any) -> bool:
    return group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER


def _check_provided(rank: int, ranks: RankTuple, group: Any) -> Optional[str]:
    """Why the caller's group for ``ranks`` cannot be used on ``rank`` (``None``: it can)."""
    if not _is_member_group(group):
        return f"rank {rank}: broadcast_groups[{ranks}] is not a process group this rank belongs to"
    try:
        actual = tuple(sorted(dist.get_process_group_ranks(group)))
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        return f"rank {rank}: broadcast_groups[{ranks}] is not a usable process group ({exc})"
    if actual != tuple(sorted(ranks)):
        return f"rank {rank}: broadcast_groups[{ranks}] holds ranks {list(actual)}"
    return None


def _missing_groups(required: Sequence[RankTuple], rank: int, provided: Optional[dict],
                    process_group: Optional[dist.ProcessGroup],
                    local_error: Optional[Exception] = None) -> list[RankTuple]:
    """The required groups to create: those some member was not given.

    Each rank only knows its own ``provided`` dict (possibly ``None`` on a rank in no
    group while others pass theirs), so whenever the load needs groups one small
    all-gather tells every rank which ones some member lacks, and reports any invalid
    entry as a ``ValueError`` on every rank before anyone enters ``new_group``.
    """
    if not required:
        if local_error is not None:
            raise local_error  # no collective follows: the pipeline's check spreads it
        return []
    provided = provided or {}
    lacking: list[RankTuple] = []
    errors: list[str] = []
    if local_error is not None:
        errors.append(f"rank {rank}: {type(local_error).__name__}: {local_error}")
    whole = _whole_world()
    for ranks in required:
        if rank not in ranks or ranks == whole:
            continue
        group = provided.get(ranks)
        if group is None:
            lacking.append(ranks)
            continue
        problem = _check_provided(rank, ranks, group)
        if problem is not None:
            errors.append(problem)
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (lacking, errors), group=process_group)
    all_errors = [e for _, errs in gathered for e in errs]
    if local_error is not None:
        raise local_error
    if all_errors:
        raise ValueError("cannot set up the broadcast load: " + "; ".join(all_errors))
    return sorted({ranks for lack, _ in gathered for ranks in lack})


def _whole_world() -> RankTuple:
    return tuple(range(dist.get_world_size()))


@contextlib.contextmanager
def broadcast_groups_for_load(
    required: Sequence[RankTuple],
    rank: int,
    provided: Optional[dict[RankTuple, Any]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    local_error: Optional[Exception] = None,
    timeout: float = 0.0,
) -> Iterator[dict[RankTuple, Any]]:
    """Yield ``{rank tuple: group}`` for the required groups ``rank`` (global) belongs to.

    ``required`` (sorted, identical on every rank, global ranks) lists the groups the load
    needs.  A group of every rank is the default group itself (nothing to create, on
    every rank alike).  Other groups some member was not given are created with
    ``dist.new_group`` — every rank of the default group enters, in the same order — and
    destroyed on exit in rank-tuple order by their members.  Groups from ``provided`` are
    used as they are and left alive.  Raises ``ValueError`` on every rank when a provided
    group does not match its key.
    ``timeout`` (seconds, 0 = the default group's) bounds the creation of new groups and
    their collectives.  ``local_error`` (this rank could not prepare its part) is raised here and, as a
    ``ValueError`` naming this rank, on every other rank — before any group exists.
    """
    to_create = _missing_groups(required, rank, provided, process_group, local_error)
    created: dict[RankTuple, Any] = {}
    usable: dict[RankTuple, Any] = {}
    if provided is not None:
        usable.update({r: provided[r] for r in required if rank in r and r in provided})
    whole = _whole_world()
    if whole in required:
        # The default group already joins every rank: creating a copy would only cost a
        # rendezvous (tens of ms on gloo) and a communicator.
        usable[whole] = dist.group.WORLD
    try:
        with phase("create_broadcast_groups", rank):
            for ranks in to_create:
                # with a deadline: the store barrier inside new_group, and the group's collectives
                group = (dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=timeout)) if timeout > 0
                         else dist.new_group(ranks=list(ranks)))
                if rank in ranks and _is_member_group(group):
                    created[ranks] = group
        usable.update(created)
        logger.debug("rank %d: %d replica groups needed, %d created here", rank, len(required), len(created))
        yield usable
    finally:
        # Only members destroy, and they all reach this point after the same last
        # broadcast on the group, so the order below is the same everywhere it matters.
        if created:
            with phase("destroy_broadcast_groups", rank):
                for ranks in sorted(created):
                    dist.destroy_process_group(created[ranks])
