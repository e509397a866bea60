"""Chunk exchanges of a resharded load (SPEC §14): a stored chunk that several ranks need
non-contiguous pieces of is read once, as one contiguous run of its rows, by its reader,
which copies its own pieces out and sends every other member its pieces point to point.

Serves the benchmark rows ``load, Shard(0)→Shard(1), under the storage cap`` (200 MB/s
shared; ``io_bench._capped_load_cases``): every rank's column slice of a chunk spans
nearly the whole chunk in the file, so reading directly the ranks together read 1.725×
(dense) and 1.984× (small tensors) the checkpoint, in 1.70-1.73× and 1.71-1.83× the time
of a same-layout load; exchanged, 1.000×, in 1.02× / 1.34× at 2 ranks and 1.08× / 1.85× at
4 (quick sizes; default sizes 1.02× / 1.22× and 1.05× / 1.33×; docs/perf/read-path.md).
Runs are read in groups of ``_GROUP_BYTES`` and sent in messages of ``_MESSAGE_BYTES``
(one 32 MiB batch and 6 MiB messages before: 4 ranks 1.19× / 2.24×).  A group's runs lie
in one buffer, so a peer's pieces of consecutive chunks of one shape go in one strided
copy, and every piece is one ``as_strided`` view, not a narrow per dimension (2000 small
tensors, 4 ranks, no transport: packing and filling 1354 → 801 ms of CPU).  From the page
cache it does not pay (gloo is slower than the copy), so ``HP_DCP_CHUNK_EXCHANGE=auto``
leaves it off there.
Exports :class:`ChunkExchanges`, and :func:`wait`, which the broadcasts share.

No deadlock: every rank posts all its receives before it sends anything (its reads begin
first, on a thread), and waits for them only after its own sends and broadcasts are launched.
"""

from __future__ import annotations

import collections
import functools
import math
import operator
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hyper_parallel_dcp.core.chunks import row_major_strides
from hyper_parallel_dcp.core.collectives import TIMEOUT_ENV
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.reader_assignment import ChunkExchange, exchanged_reads
from hyper_parallel_dcp.core.storage import ReadDestination, StorageReader

from .prefetch import ReadAhead
from .schedule import ExchangeMessage, assignment_of, exchange_messages

__all__ = ["ChunkExchanges", "wait"]

#: bytes of runs the read-ahead thread may hold ahead of the packing and sending
_AHEAD_BYTES = 32 << 20
#: bytes of runs read as one batch, and of a message at most: the pieces of one go out while
#: the next is read, and the ranks' reads of a shared link interleave
_GROUP_BYTES = 1 << 20
_MESSAGE_BYTES = 256 << 10

_EMPTY = torch.empty(0, dtype=torch.uint8)

_PieceKey = tuple[int, tuple[int, ...], tuple[int, ...]]  # (exchange position, storage_offsets, lengths)


def wait(work: Any, fail: Callable[[BaseException], BaseException], timeout: float) -> None:
    """``work.wait`` within ``timeout`` seconds (0: c10d's "no timeout"); a failure raised as
    ``fail(exc)`` (a :class:`CheckpointTimeoutError` naming the peers)."""
    try:
        work.wait(timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo: peer closed / timed out
        raise fail(exc) from exc


class _Copies:
    """Copies done together by :meth:`flush`: one ``_foreach_copy_`` for those of one dtype
    (a small-tensor load copies thousands of pieces), then the commits of what they filled."""

    def __init__(self, planner: LoadPlanner) -> None:
        self.planner = planner
        self.dests: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.commits: list[tuple[ReadItem, torch.Tensor]] = []

    def add(self, dest: torch.Tensor, source: torch.Tensor, item: Optional[ReadItem] = None) -> None:
        if dest.dtype == source.dtype:
            self.dests.append(dest)
            self.sources.append(source)
        else:
            self.casts.append((dest, source))
        if item is not None:
            self.commits.append((item, dest))

    def flush(self) -> None:
        if self.dests:
            torch._foreach_copy_(self.dests, self.sources)
        for dest, source in self.casts:
            dest.copy_(source)
        for item, dest in self.commits:
            self.planner.commit_tensor(item, dest)
        self.dests, self.sources, self.casts, self.commits = [], [], [], []


#: bytes each run's place in its group's buffer is rounded up to (any dtype views it in place)
_ALIGN = 16


class _Copy:
    """One packing copy: ``count`` pieces of box ``lengths`` of the runs of ``group``, the first
    at element ``source`` of the group's buffer (as ``dtype``, the runs' ``strides``), the next
    ``step`` elements on, to message ``message`` from byte ``at``, one after the other."""

    __slots__ = ("at", "count", "dtype", "group", "lengths", "message", "nbytes", "source", "step", "strides")

    def __init__(self, group: int, message: int, at: int, dtype: Any, lengths: tuple[int, ...],
                 strides: tuple[int, ...], source: int) -> None:
        self.group, self.message, self.at, self.dtype = group, message, at, dtype
        self.lengths, self.strides, self.source = lengths, strides, source
        self.nbytes = math.prod(lengths) * dtype.itemsize
        self.count, self.step = 1, 0


class ChunkExchanges:
    """This rank's part of the chunk exchanges of ``plan`` (its final plan).

    ``plan``: the plan's other items, for the usual read path.  :meth:`start` posts the
    receives, reads this rank's chunks and sends their pieces (≤ ``max_in_flight``
    messages of ≤ ``batch_bytes`` outstanding); :meth:`finish` waits for everything and
    fills the received pieces into the planner's targets, returning the first error (a
    failed read still sends, so no peer waits forever)."""

    def __init__(self, plan: LoadPlan, reader: StorageReader, planner: LoadPlanner, rank: int,
                 batch_bytes: int, max_in_flight: int, timeout: float) -> None:
        self.exchanges: tuple[ChunkExchange, ...] = assignment_of(plan).exchanges
        self.reader, self.planner, self.rank = reader, planner, rank
        self.timeout = timeout
        self.error: Optional[BaseException] = None
        self.bytes_sent = 0
        self.plan = plan
        self.sends: list[ExchangeMessage] = []
        self.receives: list[ExchangeMessage] = []
        self._batch_bytes = min(batch_bytes, _MESSAGE_BYTES)
        self._posted: list[tuple[ExchangeMessage, torch.Tensor, Any]] = []
        self._landed = 0  # receives filled in so far
        self._sending: collections.deque = collections.deque()  # (work, its failure, buffer)
        self._max_in_flight = max_in_flight

    def _split(self, plan: LoadPlan) -> None:
        """The pieces this rank receives, the plan's other items (``self.plan``), the messages
        (after :meth:`_lay_out`); per exchange this rank reads, its own pieces (``self._own``),
        and per group of runs its packing copies (``self._copies``): the pieces of one message
        that lie evenly spaced in the group — a peer's column slice of consecutive chunks of
        one shape — go in one strided copy (2000 small tensors on 4 ranks: 32 pieces a copy)."""
        position = {id(x): i for i, x in enumerate(self.exchanges)}
        self.items_of: dict[_PieceKey, list[ReadItem]] = collections.defaultdict(list)
        rest = []
        for item, x in exchanged_reads(plan):
            if x is None:
                rest.append(item)
            else:
                self.items_of[(position[id(x)], item.storage_offsets, item.lengths)].append(item)
        self.plan = replace(plan, items=tuple(rest))
        received: list[list] = [[] for _ in self.exchanges]
        for i, offsets, lengths in self.items_of:
            received[i].append((offsets, lengths))
        received = [sorted(r) for r in received]
        self.sends, self.receives = exchange_messages(self.exchanges, self.rank, received, self._batch_bytes)
        items_of = self.items_of
        self._own = [[(offsets, lengths, items_of[(i, offsets, lengths)]) for offsets, lengths in r]
                     if x.reader == self.rank else [] for i, (x, r) in enumerate(zip(self.exchanges, received))]
        self._copies: list[list[_Copy]] = [[] for _ in self._groups]
        self._copies_left = [0] * len(self.sends)
        for m, message in enumerate(self.sends):
            last: Optional[_Copy] = None
            for i, offsets, lengths, at in message.pieces:
                x = self.exchanges[i]
                g, start, strides = self._place[i]
                source = start + sum(map(operator.mul, (offsets[0] - x.rows[0], *offsets[1:]), strides))
                # the next piece of the last copy: same group, dtype, box and strides, evenly spaced
                # in the group and right after it in the message
                if last is not None and last.group == g and last.dtype == x.dtype and last.lengths == lengths and \
                        last.strides == strides and at == last.at + last.count * last.nbytes:
                    step = source - last.source if last.count == 1 else last.step
                    if step > 0 and source == last.source + last.count * step:
                        last.step = step
                        last.count += 1
                        continue
                last = _Copy(g, m, at, x.dtype, lengths, strides, source)
                self._copies[g].append(last)
                self._copies_left[m] += 1

    def start(self) -> None:
        """Start reading this rank's chunks, plan the messages meanwhile (``self.plan``: the
        plan's other items after it), post every receive, then send the pieces as they are read."""
        self._lay_out([i for i, x in enumerate(self.exchanges) if x.reader == self.rank])
        # read on a thread, in the order given: storage stays busy while this one plans, packs and
        # sends (the groups' buffers are made on the thread as it gets to them)
        stream = ReadAhead(lambda _: self._read_groups(), self._groups[:1],
                           max(2, min(256, _AHEAD_BYTES // _GROUP_BYTES)))
        try:
            self._split(self.plan)
        except BaseException:
            stream.close()
            raise
        for message in self.receives:
            buffer = torch.empty(message.nbytes, dtype=torch.uint8)
            self._posted.append((message, buffer, dist.irecv(buffer, src=message.peer, tag=message.tag)))
        # per sent message: its buffer (made at its first copy), as each dtype, and the copies still to do
        buffers: list[Optional[torch.Tensor]] = [None] * len(self.sends)
        typed: dict[tuple[int, Any], torch.Tensor] = {}
        left = list(self._copies_left)
        copies = _Copies(self.planner)
        try:
            for g, (_, group) in enumerate(stream):
                as_dtype: dict[Any, torch.Tensor] = {}
                for i in self._groups[g]:
                    x = self.exchanges[i]
                    run = as_dtype.get(x.dtype)
                    if run is None:
                        run = as_dtype[x.dtype] = group.view(x.dtype)
                    _, start, strides = self._place[i]
                    row0 = x.rows[0]
                    for offsets, lengths, items in self._own[i]:
                        at = start + sum(map(operator.mul, (offsets[0] - row0, *offsets[1:]), strides))
                        source = run.as_strided(lengths, strides, at)
                        for item in items:
                            copies.add(self.planner.resolve_tensor(item), source, item)
                for op in self._copies[g]:
                    m = op.message
                    held = buffers[m]
                    if held is None:
                        held = buffers[m] = torch.empty(self.sends[m].nbytes, dtype=torch.uint8)
                    into = typed.get((m, op.dtype))
                    if into is None:
                        into = typed[(m, op.dtype)] = held.view(op.dtype)
                    shape = (op.count, *op.lengths)
                    copies.add(into.as_strided(shape, row_major_strides(shape), op.at // op.dtype.itemsize),
                               as_dtype[op.dtype].as_strided(shape, (op.step, *op.strides), op.source))
                    left[m] -= 1
                    if not left[m]:
                        copies.flush()
                        self._send(self.sends[m], held)
                        for key in [k for k in typed if k[0] == m]:
                            del typed[key]
                self._land_arrived(block=False)
            copies.flush()
        except Exception as exc:  # noqa: BLE001 - raised after every message went out
            self.error = exc
        finally:
            stream.close()
        for m, message in enumerate(self.sends):  # after a failure: what is left, unfilled
            if left[m]:
                left[m] = 0
                held = buffers[m]
                self._send(message, torch.empty(message.nbytes, dtype=torch.uint8) if held is None else held)

    def _lay_out(self, mine: list[int]) -> None:
        """The runs of the chunks this rank reads (``mine``, in order), in groups of about
        ``_GROUP_BYTES`` (``self._groups``), each run at a 16-byte aligned place of its group's
        buffer (``self._place[i]``: group, element offset and strides of the run there)."""
        self._groups: list[list[int]] = []
        self._group_bytes: list[int] = []
        self._place: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        size = _GROUP_BYTES
        for i in mine:
            x = self.exchanges[i]
            if size >= _GROUP_BYTES:
                self._groups.append([])
                self._group_bytes.append(0)
                size = 0
            shape = (x.rows[1], *x.shape[1:])
            self._place[i] = (len(self._groups) - 1, size // x.dtype.itemsize, tuple(row_major_strides(shape)))
            self._groups[-1].append(i)
            size += -(-math.prod(shape) * x.dtype.itemsize // _ALIGN) * _ALIGN
            self._group_bytes[-1] = size

    def _read_groups(self) -> Iterator[tuple[ReadItem, Any]]:
        """Per group, once read: its last read and its buffer (one batch of the reader each)."""
        for g, members in enumerate(self._groups):
            group = torch.empty(self._group_bytes[g], dtype=torch.uint8)
            reads = []
            for i in members:
                x = self.exchanges[i]
                zeros = (0,) * len(x.shape)
                lengths = (x.rows[1], *x.shape[1:])
                item = ReadItem(LoadItemType.TENSOR, x.storage_index, zeros, x.storage_index,
                                (x.rows[0], *zeros[1:]), lengths, self.rank)
                start = self._place[i][1] * x.dtype.itemsize
                view = group[start:start + math.prod(lengths) * x.dtype.itemsize].view(x.dtype).view(lengths)
                reads.append(ReadDestination(item, view))
            for read, (_, filled) in zip(reads, self.reader.read_stream(reads)):
                if filled is not read.dest and read.dest is not None:  # a reader that hands back its own tensor
                    read.dest.copy_(filled)
            yield reads[-1].item, group

    def _send(self, message: ExchangeMessage, buffer: torch.Tensor) -> None:
        while len(self._sending) >= self._max_in_flight:
            self._wait_sent()
        self.bytes_sent += message.nbytes
        self._sending.append((dist.isend(buffer, dst=message.peer, tag=message.tag),
                              functools.partial(self._failed, f"to rank {message.peer}", message.peer), buffer))

    def _wait_sent(self) -> None:
        work, fail, _ = self._sending.popleft()
        wait(work, fail, self.timeout)

    def _failed(self, way: str, peer: int, exc: BaseException) -> CheckpointTimeoutError:
        return CheckpointTimeoutError(
            f"checkpoint phase 'exchange': the pieces of stored chunks sent {way} failed or did not arrive "
            f"within {self.timeout:g} s ({TIMEOUT_ENV}) on rank {self.rank}; rank {peer} died or hangs "
            f"({type(exc).__name__}: {exc})", "exchange", (peer,))

    def _land_arrived(self, block: bool) -> None:
        """Fill in the pieces of the receives that arrived (in order; ``block``: all of them)."""
        posted = self._posted
        while self._landed < len(posted):
            message, buffer, work = posted[self._landed]
            if not block and not work.is_completed():
                return
            self._landed += 1
            wait(work, functools.partial(self._failed, f"from rank {message.peer}", message.peer), self.timeout)
            if self.error is not None:
                continue
            try:
                copies = _Copies(self.planner)
                typed: dict[Any, torch.Tensor] = {}
                items_of, resolve = self.items_of, self.planner.resolve_tensor
                for i, offsets, lengths, at in message.pieces:
                    dtype = self.exchanges[i].dtype
                    as_dtype = typed.get(dtype)
                    if as_dtype is None:
                        as_dtype = typed[dtype] = buffer.view(dtype)
                    source = as_dtype.as_strided(lengths, row_major_strides(lengths), at // dtype.itemsize)
                    for item in items_of[(i, offsets, lengths)]:
                        copies.add(resolve(item), source, item)
                copies.flush()
            except Exception as exc:  # noqa: BLE001 - the other receives still complete
                self.error = exc
            posted[self._landed - 1] = (message, _EMPTY, work)  # its memory goes now

    def finish(self) -> Optional[BaseException]:
        """Wait for the sends, then for each receive, filling its pieces in; the first error."""
        try:
            while self._sending:
                self._wait_sent()
            self._land_arrived(block=True)
        except CheckpointTimeoutError as exc:
            return exc
        return self.error
