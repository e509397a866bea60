"""The read executor of a read-once + broadcast load, run on every rank instead of
``storage_reader.execute_read``: each replicated shard is read by one member of its replica
group and broadcast to the others, column slices go through :mod:`.exchange`, this rank's
tail is read last.  Exports :func:`make_read_executor`, :class:`BroadcastReadExecutor`,
:class:`BroadcastStats`, ``MAX_IN_FLIGHT``, ``DEFAULT_BATCH_BYTES``."""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hyper_parallel_dcp.core.collectives import TIMEOUT_ENV, DistWrapper, collective_timeout
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError, format_ranks
from hyper_parallel_dcp.core.planner import LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.settings import BROADCASTS_IN_FLIGHT, READ_AHEAD, fault_point, phase
from hyper_parallel_dcp.core.storage import StorageReader, commit_read, read_items, resolve_destinations

from .exchange import ChunkExchanges, wait
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

__all__ = ["DEFAULT_BATCH_BYTES", "MAX_IN_FLIGHT", "BroadcastReadExecutor", "BroadcastStats", "make_read_executor"]

#: Broadcasts outstanding at once (``HP_DCP_BROADCASTS_IN_FLIGHT``): staging ≤ this × the batch bytes.
MAX_IN_FLIGHT = BROADCASTS_IN_FLIGHT.default
#: Above the measured crossover (~4.6 MiB) where a broadcast stops being launch-bound.
DEFAULT_BATCH_BYTES = 6 * 1024 * 1024
#: From this many bytes of shards read for its groups a rank reads them on a read-ahead thread.
READ_AHEAD_MIN_BYTES = 64 << 20


@dataclass
class BroadcastStats:
    """What the last load did on this rank (for tests and benchmarks)."""

    replicated_shards: int = 0
    shards_read_for_group: int = 0
    broadcasts: int = 0
    batched_broadcasts: int = 0
    bytes_broadcast: int = 0
    tail_items: int = 0
    groups_used: int = 0
    groups_created: int = 0
    #: stored chunks this rank read or received pieces of for others (chunk exchanges), bytes it sent
    exchanged_chunks: int = 0
    bytes_exchanged: int = 0
    #: main-thread time spent launching broadcasts and waiting for them to land
    broadcast_seconds: float = 0.0


class _Reads:
    """This rank's reads for its groups, in schedule order, then its tail, on a :class:`ReadAhead`
    thread from ``READ_AHEAD_MIN_BYTES`` of shards, else inline.  After the first failure
    further reads are skipped (the broadcasts still go out); the caller raises :attr:`error`."""

    def __init__(self, reader: StorageReader, planner: LoadPlanner, ordered: list[ReadItem], depth: int) -> None:
        self.reader, self.planner = reader, planner
        self.error: Optional[BaseException] = None
        self._stream: Optional[Iterator[tuple[ReadItem, Any]]] = None
        try:
            destinations = list(resolve_destinations(planner, ordered))
            nbytes = sum(d.dest.numel() * d.dest.element_size() for d in destinations if d.dest is not None)
            if nbytes >= READ_AHEAD_MIN_BYTES:
                self._stream = ReadAhead(reader.read_stream, destinations, depth)
            elif destinations:
                self._stream = iter(reader.read_stream(destinations))
        except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
            self.error = exc

    def read(self, items: Sequence[ReadItem]) -> None:
        if self.error is not None or self._stream is None:
            return
        try:
            for expected in items:
                got, value = next(self._stream)
                if got is not expected and got != expected:
                    raise RuntimeError(f"read-ahead returned {got.dest_index.fqn!r} where "
                                       f"{expected.dest_index.fqn!r} was due (read-ahead out of order)")
                commit_read(self.planner, got, value)
        except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
            self.error = exc
            self.close()

    def read_tail(self, items: Sequence[ReadItem]) -> None:
        self.close()
        if self.error is None and items:
            try:
                read_items(self.reader, self.planner, items)
            except Exception as exc:  # noqa: BLE001 - raised after the broadcasts are done
                self.error = exc

    def close(self) -> None:
        stream, self._stream = self._stream, None
        close = getattr(stream, "close", None)
        if close is not None:
            close()


class BroadcastReadExecutor:
    """Read replicated shards once per replica group and broadcast them.

    ``groups``: caller-built ``{rank tuple: process group}``, used as is (missing ones are
    created for the load and destroyed after it).  ``batch_bytes``: smaller shards with the
    same group, source, dtype and device share one broadcast (0 disables; equal on all ranks).
    ``max_in_flight`` and ``read_ahead`` default to ``HP_DCP_BROADCASTS_IN_FLIGHT`` and
    ``HP_DCP_READ_AHEAD``.  Raises ``ValueError`` for a negative ``batch_bytes`` or
    ``max_in_flight`` below 1."""

    def __init__(self, groups: Optional[dict[tuple[int, ...], Any]] = None,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, max_in_flight: Optional[int] = None,
                 read_ahead: Optional[int] = None) -> None:
        max_in_flight = BROADCASTS_IN_FLIGHT.get() if max_in_flight is None else max_in_flight
        if not isinstance(batch_bytes, int) or batch_bytes < 0:
            raise ValueError(f"broadcast_batch_bytes must be a non-negative int, got {batch_bytes!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.groups = None if groups is None else {tuple(sorted(k)): v for k, v in groups.items()}
        self.batch_bytes = batch_bytes
        self.max_in_flight = max_in_flight
        self.read_ahead = READ_AHEAD.get() if read_ahead is None else read_ahead
        self.stats = BroadcastStats()
        self._timeout = 0.0

    def __call__(self, plan: LoadPlan, storage_reader: StorageReader, planner: LoadPlanner,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Run this rank's part of the load (``plan``: its final plan); every rank calls.
        Raises ``ValueError`` on every rank for inconsistent plans, unusable ``groups`` or
        another rank's planner error (before any group exists); a read failure after this
        rank's broadcasts are done."""
        me = dist.get_rank()
        self._timeout = collective_timeout()
        exchanges = ChunkExchanges(plan, storage_reader, planner, me, self.batch_bytes or DEFAULT_BATCH_BYTES,
                                   self.max_in_flight, self._timeout)
        if exchanges.exchanges:
            with phase("exchange_chunks", me):
                exchanges.start()
        error: Optional[BaseException] = None
        try:
            self._read_and_broadcast(exchanges.plan, storage_reader, planner, process_group, me)
        finally:
            if exchanges.exchanges:
                with phase("exchange_chunks_wait", me):
                    error = exchanges.finish()
                self.stats.exchanged_chunks = len(exchanges.exchanges)
                self.stats.bytes_exchanged = exchanges.bytes_sent
        if error is not None:
            raise error

    def _read_and_broadcast(self, plan: LoadPlan, storage_reader: StorageReader, planner: LoadPlanner,
                            process_group: Optional[dist.ProcessGroup], me: int) -> None:
        required = required_groups(plan)
        if not required:
            # nothing is replicated anywhere (the same on every rank): the plain read path
            self.stats = BroadcastStats(tail_items=len(plan.items))
            storage_reader.execute_read(plan, planner)
            return
        # what can fail on one rank alone fails before the groups exist, and travels with their exchange
        try:
            schedule = rank_schedule(plan, me, storage_reader.sort_items)
            shards = [planner.resolve_shard(task.dest_index) for task in schedule.shards]
            steps = plan_broadcasts([ShardInfo(task.ranks, task.source, t.dtype, t.numel() * t.element_size(),
                                               str(t.device)) for task, t in zip(schedule.shards, shards)],
                                    self.batch_bytes)
            local_error: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the group exchange
            schedule, shards, steps, local_error = RankSchedule((), ()), [], [], exc
        self.stats = BroadcastStats(replicated_shards=len(schedule.shards), tail_items=len(schedule.tail))
        # every wait has a deadline: the arrival checks name a rank that died before the exchange
        arrivals = DistWrapper(process_group, use_dist=True)
        arrivals.arrive("broadcast_groups")
        with broadcast_groups_for_load(required, me, self.groups, process_group, local_error=local_error,
                                       timeout=self._timeout) as groups:
            self.stats.groups_used = len(groups)
            self.stats.groups_created = sum(1 for k, g in groups.items()
                                            if g is not dist.group.WORLD and (self.groups or {}).get(k) is not g)
            mine = [it for task in schedule.shards if task.source == me for it in task.items]
            reads = _Reads(storage_reader, planner, mine, self.read_ahead)
            try:
                fault_point("load.broadcast", me)
                arrivals.arrive("broadcast")
                with phase("read_and_broadcast", me):
                    self._walk(steps, schedule.shards, shards, schedule.tail, reads, groups, me, planner)
            finally:
                reads.close()
        if reads.error is not None:
            raise reads.error

    def _walk(self, steps: list, tasks: Sequence[ShardTask], shards: list[torch.Tensor], tail: Sequence[ReadItem],
              reads: _Reads, groups: dict[tuple[int, ...], Any], me: int, planner: LoadPlanner) -> None:
        """Read and broadcast in step order, read the tail while the last are in flight, land them all."""
        pending: collections.deque = collections.deque()  # (work, its failure, land or None, buffer)
        for step in steps:
            if isinstance(step, LaunchStep):
                started = time.perf_counter()
                while len(pending) >= self.max_in_flight:
                    self._complete(pending.popleft())
                pending.append(self._launch(step.op, tasks, shards, groups, me, planner))
                self.stats.broadcast_seconds += time.perf_counter() - started
            elif tasks[step.index].source == me:
                self.stats.shards_read_for_group += 1
                reads.read(tasks[step.index].items)
        reads.read_tail(tail)  # nobody waits for these: they overlap the broadcasts in flight
        started = time.perf_counter()
        while pending:
            self._complete(pending.popleft())
        # On an accelerator wait() only orders streams: finish before the groups go.
        for device in {t.device for t in shards if t.device.type not in ("cpu", "meta")}:
            torch.accelerator.synchronize(device)
        self.stats.broadcast_seconds += time.perf_counter() - started

    def _launch(self, op: BroadcastOp, tasks: Sequence[ShardTask], shards: list[torch.Tensor],
                groups: dict[tuple[int, ...], Any], me: int, planner: LoadPlanner) -> tuple:
        group = groups.get(op.ranks)
        if group is None:
            raise RuntimeError(f"rank {me}: no process group for replica group {list(op.ranks)}")
        targets = [shards[i] for i in op.shards]
        receiving = op.source != me
        views: Optional[list[torch.Tensor]] = None
        if op.batched:
            buffer = torch.empty(sum(t.numel() for t in targets), dtype=targets[0].dtype, device=targets[0].device)
            views = [v.view(t.shape) for v, t in zip(buffer.split([t.numel() for t in targets]), targets)]
            if not receiving:
                torch._foreach_copy_(views, targets)
        elif targets[0].is_contiguous():
            buffer = targets[0]
        elif receiving:  # dist.broadcast needs contiguous memory; a narrowed shard usually is not
            buffer = torch.empty(targets[0].shape, dtype=targets[0].dtype, device=targets[0].device)
        else:
            buffer = targets[0].contiguous()
        self.stats.broadcasts += 1
        self.stats.batched_broadcasts += int(op.batched)
        self.stats.bytes_broadcast += buffer.numel() * buffer.element_size()
        fail = functools.partial(self._broadcast_error, op.ranks, op.source)
        try:
            # as bytes: every backend broadcasts those, whatever the dtype
            work = dist.broadcast(buffer.reshape(-1).view(torch.uint8), src=op.source, group=group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - a peer is gone: say which broadcast
            raise fail(exc) from exc
        if not receiving:
            return work, fail, None, buffer  # the staging copy lives until the broadcast landed
        items = [it for i in op.shards for it in tasks[i].items]

        def land() -> None:
            if views is not None:
                torch._foreach_copy_(targets, views)  # one fused scatter instead of a copy per shard
            elif buffer is not targets[0]:
                targets[0].copy_(buffer)
            for it in items:
                planner.commit_tensor(it, planner.resolve_tensor(it))

        return work, fail, land, buffer

    def _complete(self, entry: tuple) -> None:
        work, fail, land, _ = entry
        wait(work, fail, self._timeout)
        if land is not None:
            land()

    def _broadcast_error(self, ranks: tuple[int, ...], source: int, exc: BaseException) -> CheckpointTimeoutError:
        me = dist.get_rank()
        others = [r for r in ranks if r != me]
        return CheckpointTimeoutError(
            f"checkpoint phase 'broadcast': the broadcast from rank {source} to replica group "
            f"[{format_ranks(ranks)}] failed or did not finish within {self._timeout:g} s ({TIMEOUT_ENV}) on rank "
            f"{me}; rank(s) [{format_ranks(others)}] of that group died or hang ({type(exc).__name__}: {exc})",
            "broadcast", tuple(others))


#: A read executor for ``load_state_dict(..., read_executor=...)``: the class itself.
make_read_executor = BroadcastReadExecutor
