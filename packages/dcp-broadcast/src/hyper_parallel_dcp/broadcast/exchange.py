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
(one 32 MiB batch and 6 MiB messages before: 4 ranks 1.19× / 2.24×).  From the page
cache it does not pay (gloo is slower than the copy), so ``HP_DCP_CHUNK_EXCHANGE=auto``
leaves it off there.
Exports :class:`ChunkExchanges`.

No deadlock: every rank posts all its receives before it sends anything (its reads begin
first, on a thread), and waits for them only after its own sends and broadcasts are launched.
"""

from __future__ import annotations

import collections
import math
from dataclasses import replace
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from hyper_parallel_dcp.core.collectives import TIMEOUT_ENV
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.reader_assignment import ChunkExchange, ReaderAssignment, exchanged_reads
from hyper_parallel_dcp.core.storage import ReadDestination, StorageReader

from .prefetch import ReadAhead
from .schedule import ExchangeMessage, exchange_messages

__all__ = ["ChunkExchanges"]

#: bytes of runs the read-ahead thread may hold ahead of the packing and sending
_AHEAD_BYTES = 32 << 20
#: bytes of runs read as one batch, and of a message at most: the pieces of one go out while
#: the next is read, and the ranks' reads of a shared link interleave
_GROUP_BYTES = 1 << 20
_MESSAGE_BYTES = 256 << 10

_EMPTY = torch.empty(0, dtype=torch.uint8)

_PieceKey = tuple[int, tuple[int, ...], tuple[int, ...]]  # (exchange position, storage_offsets, lengths)


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


def _slice(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class ChunkExchanges:
    """This rank's part of the chunk exchanges of ``plan`` (its final plan).

    ``plan``: the plan's other items, for the usual read path.  :meth:`start` posts the
    receives, reads this rank's chunks and sends their pieces (≤ ``max_in_flight``
    messages of ≤ ``batch_bytes`` outstanding); :meth:`finish` waits for everything and
    fills the received pieces into the planner's targets, returning the first error (a
    failed read still sends, so no peer waits forever)."""

    def __init__(self, plan: LoadPlan, reader: StorageReader, planner: LoadPlanner, rank: int,
                 batch_bytes: int, max_in_flight: int, timeout: float) -> None:
        data = plan.planner_data if isinstance(plan.planner_data, ReaderAssignment) else ReaderAssignment()
        self.exchanges: tuple[ChunkExchange, ...] = data.exchanges
        self.reader, self.planner, self.rank = reader, planner, rank
        self.max_in_flight, self.timeout = max_in_flight, timeout
        self.error: Optional[BaseException] = None
        self.bytes_sent = 0
        self.plan = plan
        self.sends: list[ExchangeMessage] = []
        self.receives: list[ExchangeMessage] = []
        self._batch_bytes = min(batch_bytes, _MESSAGE_BYTES)
        self._posted: list[tuple[ExchangeMessage, torch.Tensor, Any]] = []
        self._landed = 0  # receives filled in so far
        self._sending: collections.deque = collections.deque()

    def _split(self, plan: LoadPlan) -> None:
        """The pieces this rank receives, the plan's other items (``self.plan``), the messages."""
        position = {(x.storage_index.fqn, x.storage_index.offset): i for i, x in enumerate(self.exchanges)}
        self.items_of: dict[_PieceKey, list[ReadItem]] = collections.defaultdict(list)
        rest = []
        for item, x in exchanged_reads(plan):
            if x is None:
                rest.append(item)
            else:
                i = position[(x.storage_index.fqn, x.storage_index.offset)]
                self.items_of[(i, item.storage_offsets, item.lengths)].append(item)
        self.plan = replace(plan, items=tuple(rest))
        received: list[list] = [[] for _ in self.exchanges]
        for i, offsets, lengths in self.items_of:
            received[i].append((offsets, lengths))
        self.sends, self.receives = exchange_messages(self.exchanges, self.rank, [sorted(r) for r in received],
                                                      self._batch_bytes)

    def start(self) -> None:
        """Start reading this rank's chunks, plan the messages meanwhile (``self.plan``: the
        plan's other items after it), post every receive, then send the pieces as they are read."""
        mine = [i for i, x in enumerate(self.exchanges) if x.reader == self.rank]
        nbytes = sum(self.exchanges[i].dtype.itemsize * self.exchanges[i].rows[1] *
                     math.prod(self.exchanges[i].shape[1:]) for i in mine)
        depth = max(2, min(256, len(mine) * _AHEAD_BYTES // max(nbytes, 1)))
        # read on a thread, in the order given: storage stays busy while this one plans, packs and
        # sends (the runs' buffers are made on the thread as it gets to them)
        stream = ReadAhead(lambda _: self._read_runs(mine), mine[:1], depth)
        try:
            self._split(self.plan)
        except BaseException:
            stream.close()
            raise
        for message in self.receives:
            buffer = torch.empty(message.nbytes, dtype=torch.uint8)
            self._posted.append((message, buffer, dist.irecv(buffer, src=message.peer, tag=message.tag)))
        # per sent message: its buffer (made at its first piece) and the pieces still to fill
        where: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}
        for m, message in enumerate(self.sends):
            for i, offsets, lengths, at in message.pieces:
                where[(message.peer, i, offsets, lengths)] = (m, at)
        buffers: list[Optional[torch.Tensor]] = [None] * len(self.sends)
        left = [len(message.pieces) for message in self.sends]
        copies = _Copies(self.planner)
        try:
            for i, (_, run) in zip(mine, stream):
                x = self.exchanges[i]
                row0 = x.rows[0]
                for peer, offsets, lengths in x.pieces:
                    source = _slice(run, (offsets[0] - row0, *offsets[1:]), lengths)
                    if peer == self.rank:
                        self._land(i, offsets, lengths, source, copies)
                        continue
                    m, at = where[(peer, i, offsets, lengths)]
                    held = buffers[m]
                    if held is None:
                        held = buffers[m] = torch.empty(self.sends[m].nbytes, dtype=torch.uint8)
                    copies.add(held[at:at + source.numel() * source.element_size()].view(x.dtype).view(lengths),
                               source)
                    left[m] -= 1
                    if not left[m]:
                        copies.flush()
                        self._send(self.sends[m], held)
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

    def _read_runs(self, mine: list[int]) -> Iterator[tuple[ReadItem, Any]]:
        """The runs read a group of ``_GROUP_BYTES`` at a time (one batch of the reader each)."""
        group: list[ReadDestination] = []
        size = 0
        for read in self._runs(mine):
            group.append(read)
            size += 0 if read.dest is None else read.dest.nbytes
            if size >= _GROUP_BYTES:
                yield from self.reader.read_stream(group)
                group, size = [], 0
        yield from self.reader.read_stream(group)

    def _runs(self, mine: list[int]) -> Iterator[ReadDestination]:
        """The contiguous row run of each chunk this rank reads, as reads into fresh buffers
        (made as the read-ahead thread gets to them)."""
        for i in mine:
            x = self.exchanges[i]
            zeros = (0,) * len(x.shape)
            lengths = (x.rows[1], *x.shape[1:])
            item = ReadItem(LoadItemType.TENSOR, x.storage_index, zeros, x.storage_index,
                            (x.rows[0], *zeros[1:]), lengths, self.rank)
            yield ReadDestination(item, torch.empty(lengths, dtype=x.dtype))

    def _send(self, message: ExchangeMessage, buffer: torch.Tensor) -> None:
        while len(self._sending) >= self.max_in_flight:
            entry = self._sending.popleft()
            self._wait(entry, entry[2], sending=True)
        self.bytes_sent += message.nbytes
        self._sending.append((dist.isend(buffer, dst=message.peer, tag=message.tag), buffer, message.peer))

    def _land(self, i: int, offsets: tuple[int, ...], lengths: tuple[int, ...], source: torch.Tensor,
              copies: _Copies) -> None:
        for item in self.items_of[(i, offsets, lengths)]:
            copies.add(self.planner.resolve_tensor(item), source, item)

    def _wait(self, entry: tuple, peer: int, sending: bool) -> None:
        work = entry[0]
        try:
            work.wait(timedelta(seconds=self.timeout)) if self.timeout > 0 else work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo: peer closed / timed out
            way = f"to rank {peer}" if sending else f"from rank {peer}"
            raise CheckpointTimeoutError(
                f"checkpoint phase 'exchange': the pieces of stored chunks sent {way} failed or did not arrive "
                f"within {self.timeout:g} s ({TIMEOUT_ENV}) on rank {self.rank}; rank {peer} died or hangs "
                f"({type(exc).__name__}: {exc})", "exchange", (peer,)) from exc

    def _land_arrived(self, block: bool) -> None:
        """Fill in the pieces of the receives that arrived (in order; ``block``: all of them)."""
        posted = self._posted
        while self._landed < len(posted):
            message, buffer, work = posted[self._landed]
            if not block and not work.is_completed():
                return
            self._landed += 1
            self._wait((work,), message.peer, sending=False)
            if self.error is not None:
                continue
            try:
                copies = _Copies(self.planner)
                for i, offsets, lengths, at in message.pieces:
                    dtype = self.exchanges[i].dtype
                    source = buffer[at:at + math.prod(lengths) * dtype.itemsize].view(dtype).view(lengths)
                    self._land(i, offsets, lengths, source, copies)
                copies.flush()
            except Exception as exc:  # noqa: BLE001 - the other receives still complete
                self.error = exc
            posted[self._landed - 1] = (message, _EMPTY, work)  # its memory goes now

    def finish(self) -> Optional[BaseException]:
        """Wait for the sends, then for each receive, filling its pieces in; the first error."""
        try:
            while self._sending:
                entry = self._sending.popleft()
                self._wait(entry, entry[2], sending=True)
            self._land_arrived(block=True)
        except CheckpointTimeoutError as exc:
            return exc
        return self.error
