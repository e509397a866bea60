"""The replica groups of one load: created with ``dist.new_group`` by every rank in
rank-tuple order, used once, destroyed; groups the caller passes in are used and kept.
Exports :func:`broadcast_groups_for_load`."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from hyper_parallel_dcp.core.settings import phase

__all__ = ["broadcast_groups_for_load"]

logger = logging.getLogger(__name__)

RankTuple = tuple[int, ...]


def _is_member_group(group: Any) -> bool:
    return group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER


def _provided_problem(rank: int, ranks: RankTuple, group: Any) -> Optional[str]:
    """Why the caller's group for ``ranks`` cannot be used on ``rank`` (``None``: it can)."""
    if not _is_member_group(group):
        return f"rank {rank}: broadcast_groups[{ranks}] is not a process group this rank belongs to"
    try:
        actual = tuple(sorted(dist.get_process_group_ranks(group)))
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        return f"rank {rank}: broadcast_groups[{ranks}] is not a usable process group ({exc})"
    if actual != tuple(sorted(ranks)):
        return f"rank {rank}: broadcast_groups[{ranks}] holds ranks {list(actual)}"
    return None


def _groups_to_create(required: Sequence[RankTuple], rank: int, provided: dict, whole: RankTuple,
                      process_group: Optional[dist.ProcessGroup], local_error: Optional[Exception]) -> list[RankTuple]:
    """The required groups some member was not given; errors on any rank raised on every rank."""
    lacking: list[RankTuple] = []
    errors = [] if local_error is None else [f"rank {rank}: {type(local_error).__name__}: {local_error}"]
    for ranks in required:
        if rank in ranks and ranks != whole:
            group = provided.get(ranks)
            if group is None:
                lacking.append(ranks)
            elif (problem := _provided_problem(rank, ranks, group)) is not None:
                errors.append(problem)
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (lacking, errors), group=process_group)
    if local_error is not None:
        raise local_error
    all_errors = [e for _, errs in gathered for e in errs]
    if all_errors:
        raise ValueError("cannot set up the broadcast load: " + "; ".join(all_errors))
    return sorted({ranks for lack, _ in gathered for ranks in lack})


@contextlib.contextmanager
def broadcast_groups_for_load(required: Sequence[RankTuple], rank: int,
                              provided: Optional[dict[RankTuple, Any]] = None,
                              process_group: Optional[dist.ProcessGroup] = None,
                              local_error: Optional[Exception] = None,
                              timeout: float = 0.0) -> Iterator[dict[RankTuple, Any]]:
    """Yield ``{rank tuple: group}`` for the ``required`` groups that ``rank`` belongs to.

    Groups from ``provided`` are used as they are, the others created with ``dist.new_group``
    and destroyed on exit.  Raises ``ValueError`` on every rank when a provided group does
    not match its key; ``local_error`` is raised here and, as a ``ValueError`` naming this
    rank, on every other rank, before any group exists."""
    if not required:
        if local_error is not None:
            raise local_error  # no collective follows: the pipeline's check spreads it
        yield {}
        return
    whole = tuple(range(dist.get_world_size()))
    provided = provided or {}
    to_create = _groups_to_create(required, rank, provided, whole, process_group, local_error)
    usable = {r: provided[r] for r in required if rank in r and r in provided}
    if whole in required:  # a copy of the default group would only cost a rendezvous
        usable[whole] = dist.group.WORLD
    created: dict[RankTuple, Any] = {}
    try:
        with phase("create_broadcast_groups", rank):
            for ranks in to_create:
                group = dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=timeout) if timeout > 0 else None)
                if rank in ranks and _is_member_group(group):
                    created[ranks] = group
        usable.update(created)
        logger.debug("rank %d: %d replica groups needed, %d created here", rank, len(required), len(created))
        yield usable
    finally:
        # Only members destroy, all after the same last broadcast on the group.
        if created:
            with phase("destroy_broadcast_groups", rank):
                for ranks in sorted(created):
                    dist.destroy_process_group(created[ranks])
