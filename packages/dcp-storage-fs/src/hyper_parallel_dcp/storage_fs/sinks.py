"""Where the reader's bytes go: :func:`read_slice_into` (through :func:`byte_runs` of a
:class:`PosixFile` or an object store's file), :func:`copy_into` and the sinks
:class:`AdjacentReads`, :class:`DeviceReads`, :class:`PendingCopies`, each with ``add``
(queue or refuse), ``flush`` (do it; before a file closes) and ``clear`` (forget it)."""

from __future__ import annotations

import functools
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span

from .host_memory import PINNED_BUFFER_BYTES, PinnedBuffer, accelerator_available
from .posix import IOV_MAX_BUFFERS, PREADV_MAX_BYTES, pread_exact, readv_exact, tensor_bytes

__all__ = ["AdjacentReads", "DeviceReads", "PendingCopies", "PosixFile", "byte_runs", "copy_into", "read_slice_into"]

COPY_ALONE_MIN_BYTES = 1 << 20  # from this size a host copy goes alone, not in the batched _foreach_copy_
READ_SPLIT_BYTES = 4 << 20  # a device read batch larger than this is filled by READ_THREADS threads
READ_THREADS = 4

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# dtypes whose same-dtype copy_ is a plain bit copy on every device; not bool (its copy
# stores every non-zero byte as 1, and a checkpoint gives back the bytes it was given)
_PLAIN = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8})


def copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``; a same-dtype copy goes bit for bit through an integer view (any dtype)."""
    view = _BITS.get(dest.dtype.itemsize) if dest.dtype == source.dtype and dest.dtype not in _BITS.values() else None
    if view is not None and dest.device.type != "meta":
        dest.view(view).copy_(source.view(view))
    else:
        dest.copy_(source)


class PosixFile:
    """An open file read with ``preadv`` (``fd``; ``name`` shows it in errors): its reads are
    done when :meth:`read_into` returns, and a slice's span is read whole (no gap is worth a call)."""

    gap_overhead = math.inf
    lands_later = False

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name

    def read_into(self, start: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in turn from the bytes at ``start``; :class:`CorruptCheckpointError` if the file ends first."""
        readv_exact(self.fd, buffers, start, self.name)


def byte_runs(chunk_sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
              itemsize: int, overhead: float) -> list[tuple[int, int]]:
    """``(start, length)`` byte ranges (relative to the chunk), in order, covering the box
    ``offsets + lengths`` of a row-major chunk: one per contiguous run, the smallest gaps
    merged while the bytes fetched stay within ``1 + overhead`` times those needed."""
    if not lengths:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    first, span, contiguous = slice_span(chunk_sizes, offsets, lengths)
    if contiguous or overhead == math.inf:
        return [(first * itemsize, span * itemsize)]
    strides = row_major_strides(chunk_sizes)
    # the innermost dims the box spans fully form one contiguous run with the dim before
    k = len(lengths) - 1
    while k > 0 and lengths[k] == chunk_sizes[k]:
        k -= 1
    run = lengths[k] * strides[k] * itemsize
    starts = [(sum(i * s for i, s in zip(idx, strides)) + offsets[k] * strides[k]) * itemsize
              for idx in itertools.product(*[range(o, o + n) for o, n in zip(offsets[:k], lengths[:k])])]
    gaps = [b - a - run for a, b in zip(starts, starts[1:])]
    budget = overhead * run * len(starts)
    merged = [False] * len(gaps)
    for i in sorted(range(len(gaps)), key=gaps.__getitem__):
        if gaps[i] > budget:
            break
        budget -= gaps[i]
        merged[i] = True
    out = [(starts[0], run)]
    for i, start in enumerate(starts[1:]):
        if merged[i]:
            out[-1] = (out[-1][0], start + run - out[-1][0])
        else:
            out.append((start, run))
    return out


def read_slice_into(file: Any, data_offset: int, chunk_sizes: Sequence[int], dtype: torch.dtype,
                    offsets: Sequence[int], lengths: Sequence[int], dest: torch.Tensor,
                    strides: Optional[Sequence[int]] = None, copies: Optional[PendingCopies] = None) -> int:
    """Fill ``dest`` from the slice ``offsets + lengths`` of the chunk at ``data_offset`` of
    ``file`` (a :class:`PosixFile` or any object with its ``read_into``, ``gap_overhead`` and
    ``lands_later``): straight into a contiguous host ``dest`` of ``dtype``, else through a
    staging buffer filled with :func:`byte_runs`, copied now or, where the file's reads land
    later, by ``copies``.  Returns the file bytes read; raises what ``file.read_into`` raises."""
    first, span, contiguous = slice_span(chunk_sizes, offsets, lengths)
    if span == 0:
        return 0
    itemsize = dtype.itemsize
    if contiguous and dest.is_cpu and dest.dtype == dtype and dest.is_contiguous():
        file.read_into(data_offset + first * itemsize, [tensor_bytes(dest)])
        return span * itemsize
    pin = dest.device.type not in ("cpu", "meta") and accelerator_available()
    staging = torch.empty(span, dtype=dtype, pin_memory=pin)
    view, base, read = tensor_bytes(staging), first * itemsize, 0
    for start, length in byte_runs(chunk_sizes, offsets, lengths, itemsize, file.gap_overhead):
        file.read_into(data_offset + start, [view[start - base:start - base + length]])
        read += length
    strides = row_major_strides(chunk_sizes) if strides is None else strides
    source = staging.view(tuple(lengths)) if contiguous else staging.as_strided(tuple(lengths), tuple(strides))
    if copies is None or not file.lands_later:
        copy_into(dest, source)
    else:
        copies.add(dest, source, math.prod(lengths) * itemsize)
    return read


class AdjacentReads:
    """Contiguous reads whose ranges of one file follow each other, in one ``file.read_into``
    (a ``preadv``, or one ranged GET)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the queued reads."""
        self.file: Any = None
        self.start = self.end = 0
        self.buffers: list[memoryview] = []

    def add(self, file: Any, start: int, dest: torch.Tensor, dtype: torch.dtype) -> bool:
        """Queue reading ``dest``'s bytes of ``file`` at ``start``; ``False`` (nothing queued)
        unless ``dest`` is a contiguous CPU tensor of ``dtype``."""
        if not (dest.is_cpu and dest.dtype is dtype and dest.is_contiguous()):
            return False
        nbytes = dest.nbytes
        if nbytes == 0:
            return True
        if self.buffers and (file is not self.file or start != self.end or len(self.buffers) >= IOV_MAX_BUFFERS
                             or self.end - self.start >= PREADV_MAX_BYTES):
            self.flush()
        if not self.buffers:
            self.file, self.start, self.end = file, start, start
        self.buffers.append(tensor_bytes(dest))
        self.end += nbytes
        return True

    def flush(self) -> None:
        """Perform the queued reads."""
        if self.buffers:
            file, start, buffers = self.file, self.start, self.buffers
            self.clear()
            file.read_into(start, buffers)


@functools.cache  # made on first use (a race makes a second pool, never used again)
def _read_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="hp-dcp-read")


class DeviceReads:
    """Contiguous reads into accelerator tensors through one reused pinned buffer, emptied
    by a non-blocking ``_foreach_copy_``; :meth:`wait` returns once every copy landed."""

    _SPLIT = READ_SPLIT_BYTES

    def __init__(self, capacity: int = PINNED_BUFFER_BYTES, pin: Optional[bool] = None) -> None:
        self.capacity = capacity
        self._buffer = PinnedBuffer(capacity, pin)
        self._events: list[Any] = []  # mark the end of the copies out of the buffer
        self._queue: list[tuple[int, str, int, int, torch.Tensor]] = []  # (fd, path, offset, bytes, dest)
        self._queued = 0

    def add(self, fd: int, path: str, start: int, dest: torch.Tensor, dtype: torch.dtype) -> bool:
        """Queue reading ``dest``'s bytes of ``fd`` at ``start``; ``False`` (nothing queued)
        unless ``dest`` is a contiguous tensor of ``dtype`` with storage (not ``meta``)."""
        if dest.device.type == "meta" or dest.dtype is not dtype or not dest.is_contiguous():
            return False
        nbytes = dest.numel() * dest.element_size()
        if nbytes == 0:
            return True
        target = dest.reshape(-1).view(torch.uint8)
        if nbytes > self.capacity:
            self.flush()
            for part in range(0, nbytes, self.capacity):
                length = min(self.capacity, nbytes - part)
                self._queue.append((fd, path, start + part, length, target[part:part + length]))
                self._queued = length
                self.flush()
            return True
        if self._queued + nbytes > self.capacity:
            self.flush()
        self._queue.append((fd, path, start, nbytes, target))
        self._queued += nbytes
        return True

    def flush(self) -> None:
        """Read the queued slices into the buffer and start their copies to the device."""
        if not self._queue:
            return
        queue, self._queue, self._queued = self._queue, [], 0
        self.wait()  # the buffer's previous copies have landed
        buffer = self._buffer.get(self.capacity)
        fills: list[list[Any]] = []  # [fd, path, file offset, buffer offset, bytes], ranges that follow joined
        sources: list[torch.Tensor] = []
        position = 0
        for fd, path, start, nbytes, _ in queue:
            last = fills[-1] if fills else None
            if last is not None and last[0] == fd and last[2] + last[4] == start:
                last[4] += nbytes
            else:
                fills.append([fd, path, start, position, nbytes])
            sources.append(buffer[position:position + nbytes])
            position += nbytes
        view = tensor_bytes(buffer)
        if position > self._SPLIT:
            fills = [[fd, path, start + at, offset + at, min(self._SPLIT, nbytes - at)]
                     for fd, path, start, offset, nbytes in fills for at in range(0, nbytes, self._SPLIT)]
            list(_read_pool().map(lambda fill: pread_exact(fill[0], view[fill[3]:fill[3] + fill[4]], fill[2], fill[1]),
                                  fills))
        else:
            for fd, path, start, offset, nbytes in fills:
                pread_exact(fd, view[offset:offset + nbytes], start, path)
        dests = [dest for *_, dest in queue]
        devices = {dest.device for dest in dests if dest.device.type != "cpu"}
        # a device torch.accelerator does not drive gets blocking copies (no stream to mark)
        streamed = bool(devices) and accelerator_available()
        with torch.no_grad():
            torch._foreach_copy_(dests, sources, non_blocking=streamed)
        for device in devices if streamed else ():
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            self._events.append(event)

    def wait(self) -> None:
        """Return once every copy started by :meth:`flush` has landed."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def clear(self) -> None:
        """Forget the queued reads (the buffer stays for the next ones)."""
        self._queue, self._queued = [], 0


class PendingCopies:
    """Copies into host tensors, done by :meth:`flush`: small ones of a plain dtype in one
    ``torch._foreach_copy_``, the rest one by one."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the pending copies."""
        self.dests: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.others: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nbytes = 0  # of the copies add queued
        # (id of the typed mapping, shape, strides) -> (typed mapping, element starts, destinations)
        self.mapped: dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                          tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}
        # [tensor, typed mapping, shape, dest strides, source strides, dest offsets, source starts]
        self.runs: list[list[Any]] = []
        self._run: Optional[list[Any]] = None

    def add(self, dest: torch.Tensor, source: torch.Tensor, nbytes: int) -> None:
        """Queue ``copy_into(dest, source)`` (a host ``source``, ``nbytes`` the bytes copied)."""
        self.nbytes += nbytes
        if dest.is_cpu and dest.dtype is source.dtype and dest.dtype in _PLAIN and nbytes < COPY_ALONE_MIN_BYTES:
            self.dests.append(dest)
            self.sources.append(source)
        else:
            self.others.append((dest, source))

    def add_mapped(self, dest: torch.Tensor, typed: torch.Tensor, start: int, lengths: tuple[int, ...],
                   strides: tuple[int, ...], nbytes: int, region: Optional[tuple[int, tuple[int, ...]]] = None) -> None:
        """Queue copying the slice at element ``start`` of ``typed`` (``FileMapping.slice_at``)
        into ``dest``, or into ``dest.as_strided(lengths, dest_strides, offset)`` with
        ``region``; evenly spaced slices and regions are copied as one at :meth:`flush`."""
        dtype = typed.dtype
        if dest.dtype is not dtype or dtype not in _PLAIN or nbytes >= COPY_ALONE_MIN_BYTES:
            target = dest if region is None else dest.as_strided(lengths, region[1], region[0])
            self.others.append((target, typed.as_strided(lengths, strides, start)))
        elif region is None:
            self._group(typed, lengths, strides, start, dest)
        else:
            offset, dest_strides = region
            run = self._run
            if (run is not None and run[0] is dest and run[1] is typed and run[2] == lengths
                    and run[3] == dest_strides and run[4] == strides):
                run[5].append(offset)
                run[6].append(start)
            else:
                self._run = run = [dest, typed, lengths, dest_strides, strides, [offset], [start]]
                self.runs.append(run)

    def _group(self, typed: torch.Tensor, lengths: tuple[int, ...], strides: tuple[int, ...], start: int,
               dest: torch.Tensor) -> None:
        key = (id(typed), lengths, strides)  # a tensor's == compares values: keyed by id
        group = self.mapped.get(key)
        if group is None:
            group = self.mapped[key] = (typed, [], [])
        group[1].append(start)
        group[2].append(dest)

    def _view_runs(self) -> None:
        """One view per stretch of a run evenly spaced on both sides, one per region left."""
        for tensor, typed, lengths, dest_strides, strides, offsets, starts in self.runs:
            count, i = len(offsets), 0
            while i < count:
                j = i + 1
                if j < count:
                    step, source_step = offsets[j] - offsets[i], starts[j] - starts[i]
                    if (step > 0 and source_step > 0) or (step < 0 and source_step < 0):
                        j += 1
                        while j < count and offsets[j] - offsets[j - 1] == step and \
                                starts[j] - starts[j - 1] == source_step:
                            j += 1
                if j - i == 1:
                    self._group(typed, lengths, strides, starts[i], tensor.as_strided(lengths, dest_strides, offsets[i]))
                else:  # the lowest first (as_strided takes no negative stride)
                    low = i if step > 0 else j - 1
                    self._group(typed, (j - i, *lengths), (abs(source_step), *strides), starts[low],
                                tensor.as_strided((j - i, *lengths), (abs(step), *dest_strides), offsets[low]))
                i = j

    def flush(self) -> None:
        """Perform the pending copies."""
        if self.runs:
            self._view_runs()
        dests, sources, others, mapped = self.dests, self.sources, self.others, self.mapped
        self.clear()
        for (_, lengths, strides), (typed, starts, targets) in mapped.items():
            count, step = len(starts), starts[-1] - starts[0]
            if count > 1 and step > 0 and step % (count - 1) == 0 and starts == list(
                    range(starts[0], starts[-1] + 1, step // (count - 1))):  # evenly spaced
                sources.extend(typed.as_strided((count, *lengths), (step // (count - 1), *strides),
                                                starts[0]).unbind(0))
            else:
                sources.extend(typed.as_strided(lengths, strides, start) for start in starts)
            dests.extend(targets)
        if dests:
            torch._foreach_copy_(dests, sources)
        for dest, source in others:
            copy_into(dest, source)

