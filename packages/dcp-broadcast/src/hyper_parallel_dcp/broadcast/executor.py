"""The read executor of a read-once + broadcast load.

Called by the load pipeline on every rank instead of ``storage_reader.execute_read``.
Each replicated shard is read by one member of its replica group (``ReadItem.source``)
and broadcast to the others; the walk is pipelined — read, launch the async broadcast,
move on, with at most :data:`MAX_IN_FLIGHT` broadcasts outstanding — and small shards are
batched into one staging buffer per broadcast.  The reads are the normal read path
(``core.storage``: resolve the destination, ``reader.read_into`` / ``read_object``,
commit), with the middle step on a read-ahead thread when this rank reads 64 MiB or more
for its groups; only *who* reads changes.  The tail (what only this rank needs) is read on the
calling thread, as a load without broadcast reads it, while the last broadcasts are in
flight.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hyper_parallel_dcp.core.collectives import TIMEOUT_ENV, DistWrapper, collective_timeout
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError, format_ranks
from hyper_parallel_dcp.core.faults import fault_point
from hyper_parallel_dcp.core.planner import LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.settings import BROADCASTS_IN_FLIGHT, READ_AHEAD
from hyper_parallel_dcp.core.storage import StorageReader, commit_read, read_items, resolve_destinations
from hyper_parallel_dcp.core.timing import phase

from .groups import broadcast_groups_for_load
from .prefetch import ReadAhead
from .schedule import (
    BroadcastOp,
    LaunchStep,
    RankSchedule,
    ShardInfo,
    ShardTask,
    plan_broadcasts,
    rank_schedule,
    required_groups,
)

__all__ = ["BroadcastReadExecutor", "BroadcastStats", "DEFAULT_BATCH_BYTES", "MAX_IN_FLIGHT", "make_read_executor"]

#: Broadcasts outstanding at once, unless ``HP_DCP_BROADCASTS_IN_FLIGHT`` says otherwise.
#: Bounds staging memory to batch bytes × this.
MAX_IN_FLIGHT = BROADCASTS_IN_FLIGHT.default
#: Above the measured crossover (~4.6 MiB) where a broadcast stops being launch-bound.
DEFAULT_BATCH_BYTES = 6 * 1024 * 1024
#: A rank reads the shards it broadcasts on a read-ahead thread from this many bytes of
#: them; fewer are read on the calling thread (see ``_Reads``).
READ_AHEAD_MIN_BYTES = 64 << 20


def _nbytes(destinations: Sequence[Any]) -> int:
    return sum(d.dest.numel() * d.dest.element_size() for d in destinations if d.dest is not None)


@dataclass
class BroadcastStats:
    """What one load did on this rank (for tests and benchmarks)."""

    replicated_shards: int = 0
    shards_read_for_group: int = 0
    broadcasts: int = 0
    batched_broadcasts: int = 0
    bytes_broadcast: int = 0
    tail_items: int = 0
    groups_used: int = 0
    groups_created: int = 0
    #: main-thread time spent launching broadcasts and waiting for them to land
    broadcast_seconds: float = 0.0


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: every backend broadcasts bytes, whatever
    the dtype (bool, bfloat16, float8, complex)."""
    return tensor.reshape(-1).view(torch.uint8)


class _Reads:
    """This rank's reads: the shards it reads for its groups, in schedule order (on a
    read-ahead thread from ``READ_AHEAD_MIN_BYTES`` of them); then the tail, on the
    calling thread.

    The normal read path split in three: the destinations are resolved here, on the
    calling thread (``resolve_destinations``); the read-ahead thread runs the reader's
    ``read_stream`` and touches only the reader and the destinations; each
    result is committed here (``commit_read``) when the walk reaches it.  After the
    first failure further reads are skipped (the broadcasts still go out, so no peer
    waits forever); the failure is raised once the walk is over.

    The tail goes through ``core.storage.read_items`` once the thread is done with the
    reader.  Nothing is broadcast after it, so a thread would only hand each result over
    to a calling thread that waits for it; and with as many ranks as cores (the 2-core
    dev machine, 2 ranks) the two busy threads of a rank took turns on a core: a wake-up
    behind a 4–6 ms time slice, once or twice a load of 246 MiB (~40 ms).

    Below ``READ_AHEAD_MIN_BYTES`` the group shards are read on the calling thread too:
    a broadcast is asynchronous, so the next read overlaps it without a thread.  Measured
    on the 2-core dev machine, 2 ranks, old and new interleaved: the benchmark's dense
    246 MiB state dict (its replicated norms are a few KiB a rank) loaded in 39.4 instead
    of 44.3 ms, and 49.0 instead of 55.7 ms resharded; the broadcast benchmark (64 MiB
    replicated, storage capped at 200 MB/s) took 0.364 / 0.411 s on 2 / 4 ranks without
    the thread against 0.357 / 0.412 s with it.
    """

    def __init__(self, reader: StorageReader, planner: LoadPlanner, ordered: list[ReadItem], depth: int) -> None:
        self.planner = planner
        self.reader = reader
        self.error: Optional[BaseException] = None
        self._stream: Optional[ReadAhead] = None
        self._inline: Optional[Iterator[tuple[ReadItem, Any]]] = None
        if not ordered:
            return  # nothing to read for a group: no thread
        try:
            destinations = list(resolve_destinations(planner, ordered))
            if _nbytes(destinations) >= READ_AHEAD_MIN_BYTES:
                self._stream = ReadAhead(reader.read_stream, destinations, depth)
            else:
                self._inline = iter(reader.read_stream(destinations))
        except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
            self.error = exc

    def read(self, items: Sequence[ReadItem]) -> None:
        stream = self._stream if self._stream is not None else self._inline
        if self.error is not None or stream is None or not items:
            return
        try:
            for expected in items:
                got, value = next(stream)
                if got is not expected and got != expected:
                    raise RuntimeError(f"read-ahead returned {got.dest_index.fqn!r} where "
                                       f"{expected.dest_index.fqn!r} was due (read-ahead out of order)")
                commit_read(self.planner, got, value)
        except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
            self.error = exc
            self.close()

    def read_tail(self, items: Sequence[ReadItem]) -> None:
        """Read ``items`` on the calling thread, once the read-ahead thread has stopped."""
        self.close()
        if self.error is not None or not items:
            return
        try:
            read_items(self.reader, self.planner, items)
        except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
            self.error = exc

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._inline is not None:
            close = getattr(self._inline, "close", None)
            self._inline = None
            if close is not None:
                close()


@dataclass
class _Walk:
    """This rank's part of the load, planned before any group exists."""

    schedule: RankSchedule
    #: the local shard of each ``schedule.shards`` entry (what its broadcast ships)
    shards: list[torch.Tensor]
    steps: list
    #: what this rank reads for its groups, in walk order (the tail is ``schedule.tail``)
    reads: list[ReadItem]


def _synchronize(devices: set) -> None:
    for device in devices:
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize(device)
        elif device.type == "cuda":
            torch.cuda.synchronize(device)


class BroadcastReadExecutor:
    """Read replicated shards once per replica group and broadcast them.

    ``groups``: caller-built ``{rank tuple: process group}`` used as is and left alive
    (missing ones are created for the load and destroyed after it).  ``batch_bytes``:
    shards smaller than this with the same group, source, dtype and device share one
    broadcast (0 disables; must be equal on all ranks).  ``max_in_flight``: broadcasts
    outstanding at once (default ``HP_DCP_BROADCASTS_IN_FLIGHT``, 8).  ``read_ahead``: reader
    results prepared ahead on a thread (default ``HP_DCP_READ_AHEAD``, 2).  The two
    settings are read when the executor is made.
    ``stats`` describes the last call on this rank.
    """

    def __init__(self, groups: Optional[dict[tuple[int, ...], Any]] = None,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, max_in_flight: Optional[int] = None,
                 read_ahead: Optional[int] = None) -> None:
        max_in_flight = BROADCASTS_IN_FLIGHT.get() if max_in_flight is None else max_in_flight
        read_ahead = READ_AHEAD.get() if read_ahead is None else read_ahead
        if not isinstance(batch_bytes, int) or batch_bytes < 0:
            raise ValueError(f"broadcast_batch_bytes must be a non-negative int, got {batch_bytes!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.groups = None if groups is None else {tuple(sorted(k)): v for k, v in groups.items()}
        self.batch_bytes = batch_bytes
        self.max_in_flight = max_in_flight
        self.read_ahead = read_ahead
        self.stats = BroadcastStats()
        self._timeout = collective_timeout()

    def __call__(self, plan: LoadPlan, storage_reader: StorageReader, planner: LoadPlanner,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Run this rank's part of the load; every rank of ``process_group`` must call.

        ``plan`` is this rank's final plan after reader assignment; its
        ``ReaderAssignment`` lists the rank's replica groups and every group of the load.  Fills the planner's targets in place.  Raises
        ``ValueError`` (on every rank alike) for inconsistent plans, a process group that
        is not the whole world, or unusable ``groups``; an error of this rank's planner
        before the groups exist is raised here and as ``ValueError`` on the other ranks;
        a read failure is raised after this rank's broadcasts are done, so peers are
        never left waiting.
        """
        _check_whole_world(process_group)
        to_global = _global_rank_of(process_group)
        me = dist.get_rank(process_group)
        me_global = to_global(me)
        required = sorted({tuple(sorted(to_global(r) for r in ranks)) for ranks in required_groups(plan)})
        if not required:
            # Nothing is replicated anywhere (every rank got the same list of groups from
            # the coordinator, so all ranks take this branch): the plain read path, without
            # groups, read-ahead thread or exchange — 2000 sharded tensors on 2 ranks load
            # ~25 % faster.
            self.stats = BroadcastStats(replicated_shards=0, tail_items=len(plan.items))
            storage_reader.execute_read(plan, planner)
            return
        # Everything that can fail on one rank alone happens before the groups are
        # created, and a failure travels with the group exchange: no rank is left
        # inside new_group or a broadcast waiting for a rank that gave up.
        walk, local_error = self._plan_walk(plan, me, storage_reader, planner)
        self.stats = BroadcastStats(replicated_shards=len(walk.schedule.shards), tail_items=len(walk.schedule.tail))
        # Every wait below has a deadline (HP_DCP_COLLECTIVE_TIMEOUT): the arrival checks
        # name a rank that died or hangs before the group exchange and the broadcasts,
        # new groups get that timeout, and each broadcast is waited for with it.
        arrivals = DistWrapper(process_group, use_dist=True)
        arrivals.arrive("broadcast_groups")
        self._timeout = collective_timeout()
        with broadcast_groups_for_load(required, me_global, self.groups, process_group,
                                       local_error=local_error, timeout=self._timeout) as groups:
            self._count_groups(groups)
            reads = _Reads(storage_reader, planner, walk.reads, self.read_ahead)
            try:
                fault_point("load.broadcast", me_global)
                arrivals.arrive("broadcast")
                self._read_and_broadcast(walk, reads, groups, me, to_global, planner)
            finally:
                reads.close()
        if reads.error is not None:
            raise reads.error

    # -- the steps of one call ---------------------------------------------------------
    def _plan_walk(self, plan: LoadPlan, me: int, storage_reader: StorageReader,
                   planner: LoadPlanner) -> tuple[_Walk, Optional[Exception]]:
        """This rank's schedule, shards and broadcast steps; an error is returned, not
        raised, so that it reaches the other ranks through the group exchange."""
        try:
            schedule = rank_schedule(plan, me, storage_reader.sort_items)
            shards = [planner.resolve_shard(task.dest_index) for task in schedule.shards]
            infos = [ShardInfo(task.ranks, task.source, t.dtype, t.numel() * t.element_size(), str(t.device))
                     for task, t in zip(schedule.shards, shards)]
            steps = plan_broadcasts(infos, self.batch_bytes)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the group exchange
            return _Walk(RankSchedule((), ()), [], [], []), exc
        reads = [it for task in schedule.shards if task.source == me for it in task.items]
        return _Walk(schedule, shards, steps, reads), None

    def _count_groups(self, groups: dict[tuple[int, ...], Any]) -> None:
        self.stats.groups_used = len(groups)
        self.stats.groups_created = sum(1 for k, g in groups.items()
                                        if g is not dist.group.WORLD and (self.groups or {}).get(k) is not g)

    def _read_and_broadcast(self, walk: _Walk, reads: _Reads, groups: dict[tuple[int, ...], Any], me: int,
                            to_global: Callable[[int], int], planner: LoadPlanner) -> None:
        """Walk the steps: read this rank's shards, launch and land the broadcasts, then
        read the tail while the last broadcasts are in flight."""
        stats = self.stats
        pending: collections.deque = collections.deque()
        healthy = False
        try:
            with phase("read_and_broadcast", me):
                for step in walk.steps:
                    if isinstance(step, LaunchStep):
                        started = time.perf_counter()
                        while len(pending) >= self.max_in_flight:
                            self._complete(pending.popleft())
                        pending.append(self._launch(step.op, walk.schedule.shards, walk.shards, groups, me,
                                                    to_global, planner))
                        stats.broadcast_seconds += time.perf_counter() - started
                    else:
                        task = walk.schedule.shards[step.index]
                        if task.source == me:
                            stats.shards_read_for_group += 1
                            reads.read(task.items)
                # Nobody waits for these: reading them now overlaps the broadcasts
                # still in flight instead of delaying them.
                reads.read_tail(walk.schedule.tail)
                started = time.perf_counter()
                self._drain(pending, walk.shards)
                stats.broadcast_seconds += time.perf_counter() - started
            healthy = True
        finally:
            if not healthy:
                # A collective failed (a peer is gone): waiting on the rest could hang.
                pending.clear()

    def _drain(self, pending: collections.deque, shards: list[torch.Tensor]) -> None:
        """Wait for every broadcast still in flight, oldest first."""
        while pending:
            self._complete(pending.popleft())
        # On an accelerator, wait() only orders streams: let the broadcasts finish on the
        # device before their groups are destroyed.
        _synchronize({t.device for t in shards if t.device.type not in ("cpu", "meta")})

    def _launch(self, op: BroadcastOp, tasks: Sequence[ShardTask], shards: list[torch.Tensor],
                groups: dict[tuple[int, ...], Any], me: int, to_global: Callable[[int], int],
                planner: LoadPlanner) -> tuple[Any, Optional[Callable[[], Any]]]:
        """Start ``op``'s broadcast; returns ``(work, what to do once it has landed)``."""
        key = tuple(sorted(to_global(r) for r in op.ranks))
        group = groups.get(key)
        if group is None:
            raise RuntimeError(f"rank {to_global(me)}: no process group for replica group {list(key)}")
        targets = [shards[i] for i in op.shards]
        receiving = op.source != me
        stats = self.stats
        stats.broadcasts += 1
        stats.batched_broadcasts += int(op.batched)
        if op.batched:
            first = targets[0]
            staging = torch.empty(sum(t.numel() for t in targets), dtype=first.dtype, device=first.device)
            views, start = [], 0
            for t in targets:
                views.append(staging[start:start + t.numel()].view(t.shape))
                start += t.numel()
            if not receiving:
                torch._foreach_copy_(views, targets)
            buffer = staging
        else:
            views = None
            target = targets[0]
            if target.is_contiguous():
                buffer = target
            elif receiving:
                buffer = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            else:
                # dist.broadcast needs contiguous memory; a narrowed shard usually is not.
                buffer = target.contiguous()
        stats.bytes_broadcast += buffer.numel() * buffer.element_size()
        try:
            work = dist.broadcast(_as_bytes(buffer), src=to_global(op.source), group=group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - a peer is gone: say which broadcast
            raise self._broadcast_error(key, to_global(op.source), exc) from exc
        work = _Pending(work, key, to_global(op.source))
        if not receiving:
            # The staging copy must live until the broadcast has landed.
            return work, (lambda: buffer)
        items = [it for i in op.shards for it in tasks[i].items]

        def land() -> None:
            if views is not None:
                torch._foreach_copy_(targets, views)  # one fused scatter instead of a copy per shard
            elif buffer is not targets[0]:
                targets[0].copy_(buffer)
            for it in items:
                planner.commit_tensor(it, planner.resolve_tensor(it))

        return work, land

    def _broadcast_error(self, ranks: tuple[int, ...], source: int, exc: BaseException) -> CheckpointTimeoutError:
        others = [r for r in ranks if r != dist.get_rank()]
        return CheckpointTimeoutError(
            f"checkpoint phase 'broadcast': the broadcast from rank {source} to replica group "
            f"[{format_ranks(ranks)}] failed or did not finish within {self._timeout:g} s ({TIMEOUT_ENV}) on rank "
            f"{dist.get_rank()}; rank(s) [{format_ranks(others)}] of that group died or hang "
            f"({type(exc).__name__}: {exc})",
            "broadcast", tuple(others))

    def _complete(self, entry: tuple[Any, Optional[Callable[[], Any]]]) -> None:
        pending, land = entry
        try:
            if self._timeout > 0:
                pending.work.wait(timedelta(seconds=self._timeout))
            else:
                pending.work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo: peer closed / timed out
            raise self._broadcast_error(pending.ranks, pending.source, exc) from exc
        if land is not None:
            land()


@dataclass
class _Pending:
    """A broadcast in flight, with what an error about it must name."""

    work: Any
    ranks: tuple[int, ...]
    source: int


def _check_whole_world(process_group: Optional[dist.ProcessGroup]) -> None:
    world = dist.get_world_size()
    if process_group is not None and dist.get_world_size(process_group) != world:
        raise ValueError("read-once + broadcast needs the load to run on all ranks of the default group "
                         f"({dist.get_world_size(process_group)} of {world} ranks given)")


def _global_rank_of(process_group: Optional[dist.ProcessGroup]) -> Callable[[int], int]:
    if process_group is None:
        return lambda r: r
    return lambda r: dist.get_global_rank(process_group, r)


def make_read_executor(*, groups: Optional[dict[tuple[int, ...], Any]] = None,
                       batch_bytes: int = DEFAULT_BATCH_BYTES, max_in_flight: Optional[int] = None,
                       read_ahead: Optional[int] = None) -> BroadcastReadExecutor:
    """A read executor for ``load_state_dict(..., read_executor=...)``.

    See :class:`BroadcastReadExecutor`.  Raises ``ValueError`` for a negative
    ``batch_bytes`` or ``max_in_flight`` below 1.
    """
    return BroadcastReadExecutor(groups=groups, batch_bytes=batch_bytes, max_in_flight=max_in_flight,
                                 read_ahead=read_ahead)
