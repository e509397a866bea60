"""Read a stored chunk's slice straight into its destination tensor with ``preadv``.

Measured on the 2-core dev machine, 2000 × 0.5 MiB bf16 tensors from the page cache:
``preadv`` into the destination 0.11 s, ``safe_open`` mmap view + ``copy_`` 0.4–2.9 s
(every 4 KiB page faults in, and the copy competes for the cores).  So the reader hands
the kernel the destination memory whenever the slice is contiguous in the file (a
row-prefix slice: what row sharding and ragged ranges produce) and the destination is a
contiguous CPU tensor; otherwise it reads the byte span once into a host buffer (pinned
for an accelerator destination) and copies from a strided view of it.

A slice that is not contiguous in the file (a column slice: a Shard(0) checkpoint loaded
as Shard(1)) spans every row it touches, so reading its span into a buffer moves about
twice the bytes it needs, through freshly allocated memory, and copies them once more.
Given a :class:`FileMapping` of the file, such a slice of at least
``MAPPED_SLICE_MIN_BYTES`` instead has its pages mapped in one ``madvise(
MADV_POPULATE_READ)`` call and is copied straight from the page cache with one strided
``copy_``, which reads only the cache lines the slice needs.  Measured on the 2-core dev
machine, 64 Ki rows × 1024 bf16 columns, half the columns: 11 ms for a contiguous read
of the same bytes, 86 ms through the span buffer, 14 ms mapped; per-page faults without
the populate call are what made a plain mmap slow (above).  Small slices are mapped too:
the file is mapped once per reader and populated 1 MiB at a time, and a slice then costs
one ``as_strided`` (1000 × 4 KiB tensors loaded Shard(0) → Shard(1): the read phase went
from 47 to 36 ms CPU against the span buffer).  A read that walks a file forwards (a
resharded load reads its slices in file order) populates ahead of itself, the run's
length ahead up to 32 MiB, as readahead does: 2000 × 128 KiB tensors resharded on 2
ranks made 126 populate calls per file, 11 → 7 ms CPU a load.

Pages already in the page cache are not populated: ``cachestat`` (Linux 6.5+, ~30 us for
128 MiB of 256 KiB folios) says so for a block range, and the copy's own page faults map
them, each fault a whole large folio's pages at once.  The populate call walks the
range a page at a time.  Measured on a 2-core AMD EPYC VM (kernel 6.18), half the
columns of a 128 MiB file: populate + copy 5.9 + 8.1 ms against a faulting copy of
9.0 ms (256 KiB folios, what a save writes on such a VM: ``host_memory``), 20.7 against
17.5 ms for 4 KiB folios, equal for 2 MiB ones.  The 246 MiB dense benchmark state dict
loaded Shard(0) -> Shard(1) on 2 ranks: 1.32-1.46 -> 1.18-1.31 × a same-layout load.
A range not wholly cached is still populated: a failed read from disk is then an error
the caller handles, not a ``SIGBUS`` in the copy (left: a page evicted between the check
and the copy, milliseconds later, is read by the fault).

Per read, Python and dispatch cost as much as the bytes of a small tensor, so a reader
can batch: :class:`AdjacentReads` turns contiguous reads of consecutive file ranges into
one ``preadv`` (a same-layout load reads its chunks in file order), and ``read_slice``
hands back a column slice's view for ``copy_many`` (or :class:`PendingCopies`, which
sorts each pair as it is added) to copy a batch of them in one ``torch._foreach_copy_``
call.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from math import prod
from operator import mul, sub
from typing import Any, Sequence

import torch

from hyper_parallel_dcp.core.chunks import row_major_strides
from hyper_parallel_dcp.core.errors import CorruptCheckpointError

__all__ = [
    "MAPPED_SLICE_MIN_BYTES",
    "AdjacentReads",
    "DeviceReads",
    "FileMapping",
    "MappingArena",
    "PendingCopies",
    "copy_into",
    "copy_many",
    "read_slice",
    "read_slice_into",
    "readv_exact",
    "span_from_strides",
    "wait_for_unmaps",
]

_MAX_CHUNK = 1 << 30  # bytes per preadv call (Linux caps one call near 2 GiB)

#: spans at least this large of a non-contiguous slice are copied from a mapping (every
#: one: the mapping is made once per file, see above)
MAPPED_SLICE_MIN_BYTES = 0

# pages are populated a block at a time: a cold load reads at most a block's pages
# beyond the slices it needs
_BLOCK_SHIFT = 20
# a forward walk populates up to this far ahead of the slice it reads
_AHEAD_MAX_BYTES = 32 << 20
_PROT_READ, _MAP_SHARED, _MADV_POPULATE_READ = 1, 1, 22
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc_functions() -> tuple[Any, Any, Any] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn, munmap_fn, madvise_fn = libc.mmap, libc.munmap, libc.madvise
    except (OSError, AttributeError):
        return None
    mmap_fn.restype = ctypes.c_void_p
    mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    munmap_fn.restype = ctypes.c_int
    munmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    madvise_fn.restype = ctypes.c_int
    madvise_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return mmap_fn, munmap_fn, madvise_fn


_LIBC = _libc_functions() if sys.platform.startswith("linux") else None


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # one number on every architecture (Linux 6.5+)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _cachestat_function() -> Any:
    if _LIBC is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.POINTER(_CachestatRange), ctypes.POINTER(_Cachestat),
                     ctypes.c_uint]
    return call


_CACHESTAT_CALL = _cachestat_function()


def _cached(fd: int, start: int, length: int) -> bool:
    """Whether every page of the file's bytes ``[start, start + length)`` is in the page cache
    (``False`` where the kernel cannot tell: ``cachestat`` came with Linux 6.5)."""
    global _CACHESTAT_CALL
    call = _CACHESTAT_CALL
    if call is None:
        return False
    stat = _Cachestat()
    if call(_SYS_CACHESTAT, fd, ctypes.byref(_CachestatRange(start, length)), ctypes.byref(stat), 0) != 0:
        _CACHESTAT_CALL = None  # ENOSYS (an older kernel) or refused (seccomp): populate as before
        return False
    return stat.nr_cache >= (start + length + _PAGE - 1) // _PAGE - start // _PAGE


class _Unmapper:
    """Unmaps closed mappings on a thread of its own, in the order they were closed.

    Unmapping a populated mapping is kernel work proportional to its pages (a page-table
    entry per 4 KiB page, a TLB flush on each CPU the process ran on): a reader closes
    its files when the load returns, and that time was the load's (~1 ms per 123 MiB
    file).  Measured on the 2-core dev machine, 2 ranks loading a 246 MiB checkpoint
    Shard(0) → Shard(1) through a fresh reader each (both files mapped), 25 loads of
    each layout alternating, two runs each way: resharded / same-layout load 1.28 and
    1.26 unmapping in place, 1.23 and 1.24 here.  The thread starts with the first
    mapping closed; ``ctypes`` releases the GIL for the call.  A mapping waiting here is
    no longer referenced by any tensor (``FileMapping.close`` dropped its views first).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._busy = False
        self._thread: threading.Thread | None = None

    def unmap(self, addr: int, size: int) -> None:
        with self._lock:
            self._pending.append((addr, size))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hp-dcp-unmap", daemon=True)
                self._thread.start()
            self._idle.notify_all()

    def wait(self) -> None:
        """Return once every mapping closed so far is unmapped."""
        with self._lock:
            while self._pending or self._busy:
                self._idle.wait()

    def _run(self) -> None:
        assert _LIBC is not None
        munmap = _LIBC[1]
        while True:
            with self._lock:
                while not self._pending:
                    self._busy = False
                    self._idle.notify_all()
                    self._idle.wait()
                addr, size = self._pending.popleft()
                self._busy = True
            munmap(addr, size)

    def forked(self) -> None:
        # the child has the parent's mappings but not its thread: start afresh there
        self.__init__()  # type: ignore[misc]


_UNMAPPER = _Unmapper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_UNMAPPER.forked)


def wait_for_unmaps() -> None:
    """Block until every closed :class:`FileMapping` is unmapped (they are unmapped on a
    thread: see ``_Unmapper``)."""
    _UNMAPPER.wait()


class FileMapping:
    """A whole file mapped read-only and shared (the page cache's own pages, no copy).

    ``slice_view`` gives a strided tensor over a stored slice after populating the 1 MiB
    blocks it touches that are not all in the page cache (each block once, one system
    call); ``None`` when the kernel refuses (no ``MADV_POPULATE_READ`` before Linux 5.14, a range past the end of the
    file): the caller reads another way.  Views are used until the reader's batch is
    copied, before the file closes; ``close`` unmaps.  Files of a checkpoint are
    never truncated in place (every save writes new files and renames them), so a
    mapped checkpoint file keeps its size while it is open.
    """

    def __init__(self, fd: int, size: int, arena: MappingArena | None = None) -> None:
        self.size = size
        self._fd = fd
        self._addr: int | None = None
        self._data: torch.Tensor | None = None
        # the whole mapping viewed as each dtype read so far: a slice is then one
        # ``as_strided`` (slicing the bytes and viewing them costs ~3 us more a read)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._populated = bytearray((size >> _BLOCK_SHIFT) + 1)  # per block: pages populated
        self._low = self._high = 0  # the latest run of populated blocks, as a byte range
        # in an arena: the arena, the slot and where the file starts in ``typed()``'s bytes
        self._arena: MappingArena | None = None
        self._slot = -1
        self._origin = 0
        if _LIBC is None or size == 0:
            return
        placed = None if arena is None else arena.place(fd, size)
        if arena is not None and placed is not None:
            self._slot, self._addr = placed
            self._arena = arena
            self._origin = self._addr - arena.base
            self._data = arena.data
            return
        addr = _LIBC[0](None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return
        self._addr = addr
        self._data = torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=torch.uint8)

    @classmethod
    def open(cls, fd: int, size: int, arena: MappingArena | None = None) -> FileMapping | None:
        """The file open as ``fd`` (``size`` bytes) mapped, or ``None`` where it cannot be;
        in a free slot of ``arena`` when it has one (see :class:`MappingArena`)."""
        mapping = cls(fd, size, arena)
        return mapping if mapping._data is not None else None

    def slice_view(self, data_offset: int, chunk_sizes: Sequence[int], dtype: torch.dtype,
                   first: int, span: int, lengths: Sequence[int],
                   strides: Sequence[int] | None = None) -> torch.Tensor | None:
        """The stored slice (``first``/``span`` elements from ``slice_span``) as a strided
        tensor over the mapping, its pages populated; ``None`` if they cannot be.
        ``strides``: the chunk's row-major strides, when the caller has them."""
        start = self.slice_start(data_offset, dtype, first, span)
        if start is None:
            return None
        return self.typed(dtype).as_strided(lengths, row_major_strides(chunk_sizes) if strides is None else strides,
                                            start)

    def slice_start(self, data_offset: int, dtype: torch.dtype, first: int, span: int) -> int | None:
        """Populate the pages of a stored slice (``first``/``span`` elements of the chunk at
        byte ``data_offset``) and return where it starts in ``typed(dtype)``, in elements;
        ``None`` if its pages cannot be populated or it is not aligned to the element size."""
        assert self._addr is not None
        itemsize = dtype.itemsize
        start = data_offset + first * itemsize
        end = start + span * itemsize
        if end > self.size or start % itemsize:
            return None  # past the end, or not aligned to the element size (a view would need a copy)
        if not (self._low <= start and end <= self._high):
            if not self._populate(start, end):
                return None
        return (self._origin + start) // itemsize

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole mapping viewed as ``dtype`` (its last bytes short of an element left
        out); in an arena, the whole arena (``slice_start`` counts from its start)."""
        typed = self._typed.get(dtype)
        if typed is None:
            if self._arena is not None:
                typed = self._typed[dtype] = self._arena.typed(dtype)
            else:
                assert self._data is not None
                itemsize = dtype.itemsize
                typed = self._typed[dtype] = self._data[:self.size - self.size % itemsize].view(dtype)
        return typed

    def _populate(self, start: int, end: int) -> bool:
        """Populate the pages of the 1 MiB blocks that bytes ``[start, end)`` touch (each
        block once, in one system call), and ahead of them when the read walks forwards;
        ``False`` when the kernel refuses.  Blocks whose pages are all in the page cache
        are left to the copy's page faults (see the module's docstring)."""
        populated = self._populated
        end_block = ((end - 1) >> _BLOCK_SHIFT) + 1
        first_block = populated.find(0, start >> _BLOCK_SHIFT, end_block)
        last_block = end_block - 1
        if first_block >= 0:
            # whole blocks, each once: the call walks every page of its range even when
            # they are mapped already (~3 us for 64 KiB, as much as the rest of a small
            # column slice's read)
            last_block = populated.rfind(0, first_block, end_block)
            if self._high and first_block << _BLOCK_SHIFT == self._high:
                # the walk goes on where the populated run ends: populate ahead, doubling
                # as the run grows, as readahead does (a resharded load of 2000 small
                # tensors made 126 calls per file, ~45 us each with both ranks mapping
                # both files; a cold load reads at most the run's length ahead)
                ahead = min(max(self._high - self._low, 1 << _BLOCK_SHIFT), _AHEAD_MAX_BYTES) >> _BLOCK_SHIFT
                limit = min(last_block + 1 + ahead, len(populated))
                taken = populated.find(1, last_block + 1, limit)
                last_block = (limit if taken < 0 else taken) - 1
            block_start = first_block << _BLOCK_SHIFT
            block_end = min((last_block + 1) << _BLOCK_SHIFT, self.size)
            assert self._addr is not None and _LIBC is not None
            if not _cached(self._fd, block_start, block_end - block_start) and \
                    _LIBC[2](self._addr + block_start, block_end - block_start, _MADV_POPULATE_READ) != 0:
                return False
            populated[first_block:last_block + 1] = b"\x01" * (last_block + 1 - first_block)
        # Every block from start's to last_block is populated now; a read walks a file
        # forwards, so the populated run it extends is remembered and the next slice
        # inside it skips the block lookups (~1.5 us of a small column slice's ~6 us)
        low = (start >> _BLOCK_SHIFT) << _BLOCK_SHIFT
        high = min((last_block + 1) << _BLOCK_SHIFT, self.size)
        if low <= self._high and high >= self._low:
            self._low, self._high = min(low, self._low), max(high, self._high)
        else:
            self._low, self._high = low, high
        return True

    def close(self) -> None:
        """Drop the views of the mapping and unmap it, on the unmapping thread (in an
        arena: free its slot, which the next file mapped there replaces)."""
        if self._addr is not None:
            self._data = None
            self._typed.clear()
            if self._arena is not None:
                self._arena.release(self._slot)
                self._arena = None
            else:
                _UNMAPPER.unmap(self._addr, self.size)
            self._addr = None
            self._low = self._high = 0

    def __del__(self) -> None:
        # A reader dropped without reset() (one per load, as the benchmark does) must not
        # keep its files mapped: the mapping outlives the file's descriptor and holds a
        # deleted checkpoint's disk space until the process exits.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_PROT_NONE, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0, 2, 0x10, 0x20, 0x4000
# a huge page on x86-64 (and the largest folio the save's aligned writes make)
_FOLIO_ALIGN = 2 << 20


class MappingArena:
    """One stretch of address space in which a reader maps its files, each in a slot of
    the same size (the largest file's, rounded up to ``_FOLIO_ALIGN``).

    A column slice of a tensor sharded by rows reads one block of rows from each rank's
    file.  Ranks' files of one save hold their chunks at the same offsets, so in slots
    of one size those blocks lie evenly spaced in one tensor's memory: a single strided
    view spans them all, and ``PendingCopies.add_region`` copies the whole slice in
    one copy into one view of the destination, not one copy and one view per file.

    The stretch is reserved without access (``PROT_NONE``, no memory committed); a file
    is mapped over its slot with ``MAP_FIXED`` and stays mapped until another file takes
    the slot (which replaces the mapping in one call) or ``close`` unmaps the stretch
    on the unmapping thread.  ``reserve`` returns ``None`` where the kernel refuses.

    Every slot starts on a 2 MiB boundary, as the kernel places a file mapped alone: a
    2 MiB page-cache folio is then mapped with one page-table entry.  The save's writes
    make such folios (except on a VM with free page reporting: ``host_memory``), and
    readahead makes some when a cold load reads a file from disk (a third of a 64 MiB
    file, measured).  With slots only page-aligned, a 125 MiB file of 2 MiB folios took
    3.8 ms to populate instead of 0.1 (measured on the 2-core dev machine).
    """

    def __init__(self, base: int, slot_bytes: int, slots: int, reserved: tuple[int, int] | None = None) -> None:
        self.base = base
        self.slot_bytes = slot_bytes
        self.size = slot_bytes * slots
        # the whole reservation (it may begin below base, to align base), unmapped at close
        self._reserved = reserved if reserved is not None else (base, self.size)
        self.data: torch.Tensor | None = torch.frombuffer(
            (ctypes.c_char * self.size).from_address(base), dtype=torch.uint8)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._free = list(range(slots - 1, -1, -1))  # taken from the end: slot 0 first

    @classmethod
    def reserve(cls, slot_bytes: int, slots: int) -> MappingArena | None:
        """An arena of ``slots`` slots of at least ``slot_bytes`` each, each starting on a
        ``_FOLIO_ALIGN`` boundary, or ``None``."""
        if _LIBC is None or slot_bytes <= 0 or slots <= 0:
            return None
        slot_bytes = -(-slot_bytes // _FOLIO_ALIGN) * _FOLIO_ALIGN
        size = slot_bytes * slots + _FOLIO_ALIGN  # room to move the start to a boundary
        addr = _LIBC[0](None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
        return cls(-(-addr // _FOLIO_ALIGN) * _FOLIO_ALIGN, slot_bytes, slots, (addr, size))

    def place(self, fd: int, size: int) -> tuple[int, int] | None:
        """Map the file open as ``fd`` (``size`` bytes) read-only in a free slot: ``(slot,
        address)``, or ``None`` (no free slot, too large, the arena closed, refused)."""
        if self.data is None or not self._free or size > self.slot_bytes:
            return None
        assert _LIBC is not None
        slot = self._free[-1]
        addr = self.base + slot * self.slot_bytes
        placed = _LIBC[0](addr, size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if placed != addr:
            # a failed MAP_FIXED may have unmapped the slot's range: reserve it again,
            # or give the arena up (close unmaps the stretch, whatever it holds)
            again = _LIBC[0](addr, self.slot_bytes, _PROT_NONE,
                             _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
            if again != addr:
                self._free.clear()
            return None
        self._free.pop()
        return slot, addr

    def release(self, slot: int) -> None:
        """Free ``slot`` (its file's mapping stays until the next file replaces it)."""
        if self.data is not None:
            self._free.append(slot)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole stretch viewed as ``dtype`` (only the slots holding a file are read)."""
        typed = self._typed.get(dtype)
        if typed is None:
            assert self.data is not None
            typed = self._typed[dtype] = self.data[:self.size - self.size % dtype.itemsize].view(dtype)
        return typed

    def close(self) -> None:
        """Drop the views and unmap the whole stretch (every file in it), on the unmapping
        thread.  The files' mappings must not be used afterwards."""
        if self.data is not None:
            self.data = None
            self._typed.clear()
            self._free.clear()
            _UNMAPPER.unmap(*self._reserved)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _buffer(tensor: torch.Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done : done + _MAX_CHUNK]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: needed {total} bytes at offset {offset}, the file ends after {done}"
            )
        done += n


def readv_exact(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    """Fill ``buffers`` in turn from the file bytes starting at ``offset`` (one ``preadv``
    while the kernel returns everything); raises as ``_pread_exact`` on a short file."""
    total = sum(map(len, buffers))
    done = os.preadv(fd, buffers, offset) if total <= _MAX_CHUNK else 0
    if done == total:
        return
    for view in buffers:  # a short read (a signal, a huge batch): the rest one by one
        if done >= len(view):
            done -= len(view)
            offset += len(view)
            continue
        _pread_exact(fd, view[done:], offset + done, path)
        offset += len(view)
        done = 0


class AdjacentReads:
    """Contiguous reads whose file ranges follow each other, gathered into one ``preadv``.

    A same-layout load reads its chunks in file order, each into its own tensor: 2000
    small tensors become a few system calls instead of 2000.  ``add`` queues a read (or
    refuses it), ``flush`` performs the queued ones; the caller flushes before the file
    closes and before it hands the destinations on.
    """

    _MAX_BUFFERS = 512  # below IOV_MAX (1024 on Linux)

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the queued reads."""
        self.fd = -1
        self.path = ""
        self.start = 0
        self.end = 0
        self.buffers: list[memoryview] = []

    def add(self, fd: int, path: str, start: int, dest: torch.Tensor, dtype: torch.dtype) -> bool:
        """Queue reading ``dest.nbytes`` bytes of ``fd`` at ``start`` into ``dest``; ``False``
        (nothing queued) unless ``dest`` is a contiguous CPU tensor of ``dtype``."""
        if not (dest.is_cpu and dest.dtype is dtype and dest.is_contiguous()):
            return False
        nbytes = dest.nbytes
        if nbytes == 0:
            return True
        if self.buffers and (fd != self.fd or start != self.end or len(self.buffers) >= self._MAX_BUFFERS
                             or self.end - self.start >= _MAX_CHUNK):
            self.flush()
        if not self.buffers:
            self.fd, self.path, self.start, self.end = fd, path, start, start
        self.buffers.append(_buffer(dest))
        self.end += nbytes
        return True

    def flush(self) -> None:
        """Perform the queued reads."""
        if self.buffers:
            fd, path, start, buffers = self.fd, self.path, self.start, self.buffers
            self.clear()
            readv_exact(fd, buffers, start, path)


class DeviceReads:
    """Contiguous reads into accelerator tensors, through one reused page-locked buffer.

    Read one by one, each slice went through a fresh page-locked span buffer and a
    blocking host -> device copy: measured on an H200 host, 1 GiB (32 matrices of 32 MiB
    and 2000 tensors of 4 KiB) loaded from the page cache in 0.30 s, where a pinned host
    -> device copy of the same bytes takes 0.02 s.  Here the queued reads fill the buffer
    back to back (adjacent file ranges in one ``preadv``; a large fill split over a few
    threads, as ``preadv`` releases the GIL), and its slices go to their destinations in
    one ``torch._foreach_copy_(non_blocking=True)``, whose completion an event marks;
    the buffer is filled again only after that event.  A slice larger than the buffer
    streams through it in parts.  ``flush`` performs the queued reads and starts the
    copies; ``wait`` returns once every copy has landed (the caller waits before it
    hands the destinations on).  Measured on the same host (16 cores), the same state
    loaded from the page cache (best of 3): 278 ms one by one, 169 ms through this class;
    reading the files into pinned memory on one thread and copying them over took 226 ms.
    """

    CAPACITY = 64 << 20  # bytes of the page-locked buffer (allocated on first use)
    _SPLIT = 4 << 20  # a fill of more than this is read by several threads
    _THREADS = 4

    def __init__(self, capacity: int = CAPACITY, pin: bool | None = None) -> None:
        self.capacity = capacity
        self._pin = pin
        self._buffer: torch.Tensor | None = None
        self._events: list[Any] = []  # mark the end of the copies out of the buffer
        # queued: (fd, path, file offset, bytes, destination as uint8)
        self._queue: list[tuple[int, str, int, int, torch.Tensor]] = []
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
                self._queue.append((fd, path, start + part, length, target[part : part + length]))
                self._queued = length
                self.flush()
            return True
        if self._queued + nbytes > self.capacity:
            self.flush()
        self._queue.append((fd, path, start, nbytes, target))
        self._queued += nbytes
        return True

    def _staging(self) -> torch.Tensor:
        if self._buffer is None:
            pin = _accelerator_available() if self._pin is None else self._pin
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        return self._buffer

    def flush(self) -> None:
        """Read the queued slices into the buffer and start their copies to the device."""
        if not self._queue:
            return
        queue, self._queue, self._queued = self._queue, [], 0
        self.wait()  # the buffer's previous copies have landed
        buffer = self._staging()
        # (fd, path, file offset, buffer offset, bytes): file ranges that follow each other joined
        fills: list[list[Any]] = []
        sources: list[torch.Tensor] = []
        position = 0
        for fd, path, start, nbytes, _ in queue:
            last = fills[-1] if fills else None
            if last is not None and last[0] == fd and last[2] + last[4] == start:
                last[4] += nbytes
            else:
                fills.append([fd, path, start, position, nbytes])
            sources.append(buffer[position : position + nbytes])
            position += nbytes
        if position > self._SPLIT:
            parts = [(fd, path, start + at, offset + at, min(self._SPLIT, nbytes - at))
                     for fd, path, start, offset, nbytes in fills for at in range(0, nbytes, self._SPLIT)]
            list(_read_pool().map(lambda part: self._fill(buffer, *part), parts))
        else:
            for fill in fills:
                self._fill(buffer, *fill)
        dests = [dest for *_, dest in queue]
        devices = {dest.device for dest in dests if dest.device.type != "cpu"}
        # a device torch.accelerator does not drive gets blocking copies (no stream to mark)
        streamed = bool(devices) and _accelerator_available()
        with torch.no_grad():
            torch._foreach_copy_(dests, sources, non_blocking=streamed)
        for device in devices if streamed else ():
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            self._events.append(event)

    @staticmethod
    def _fill(buffer: torch.Tensor, fd: int, path: str, start: int, offset: int, nbytes: int) -> None:
        _pread_exact(fd, _buffer(buffer)[offset : offset + nbytes], start, path)

    def wait(self) -> None:
        """Return once every copy started by ``flush`` has landed."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def clear(self) -> None:
        """Forget the queued reads (the buffer stays for the next ones)."""
        self._queue, self._queued = [], 0


_POOL: Any = None
_POOL_LOCK = threading.Lock()


def _read_pool() -> Any:
    """The threads that fill a :class:`DeviceReads` buffer (made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(DeviceReads._THREADS, thread_name_prefix="hp-dcp-read")
        return _POOL


def read_slice_into(
    fd: int,
    path: str,
    data_offset: int,
    chunk_sizes: Sequence[int],
    dtype: torch.dtype,
    offsets: Sequence[int],
    lengths: Sequence[int],
    dest: torch.Tensor,
    mapping: FileMapping | None = None,
) -> int:
    """Fill ``dest`` (shape ``lengths``) from the slice ``offsets+lengths`` of a stored chunk.

    ``data_offset`` is the file offset of the chunk's first byte; ``mapping``, when given,
    maps the same file (used for large non-contiguous slices into host memory).  Returns
    the bytes of the file the read spans (``core.chunks.slice_span`` × item size: what
    ``hp-dcp explain`` predicts).  Raises :class:`CorruptCheckpointError` on a short file.
    """
    spanned, source = read_slice(fd, path, data_offset, chunk_sizes, dtype, offsets, lengths, dest, mapping)
    if source is not None:
        _copy_wide(dest, source)
    return spanned


def read_slice(
    fd: int,
    path: str,
    data_offset: int,
    chunk_sizes: Sequence[int],
    dtype: torch.dtype,
    offsets: Sequence[int],
    lengths: Sequence[int],
    dest: torch.Tensor,
    mapping: FileMapping | None = None,
    strides: Sequence[int] | None = None,
) -> tuple[int, torch.Tensor | None]:
    """``read_slice_into`` that may leave the copy to the caller: returns ``(bytes spanned,
    source)``, where ``source`` is ``None`` when ``dest`` is filled, else a view of
    ``mapping`` to copy into ``dest`` (``copy_many`` copies a batch of them in one call)
    while the mapping is open.  ``strides``: the chunk's row-major strides, if known.
    """
    itemsize = dtype.itemsize
    if strides is None:
        strides = row_major_strides(chunk_sizes)
    first, span, contiguous = span_from_strides(strides, offsets, lengths)
    if span == 0:
        return 0, None
    start = data_offset + first * itemsize
    on_cpu = dest.is_cpu
    if contiguous and on_cpu and dest.dtype == dtype and dest.is_contiguous():
        _pread_exact(fd, _buffer(dest), start, path)
        return span * itemsize, None
    if mapping is not None and on_cpu and span * itemsize >= MAPPED_SLICE_MIN_BYTES:
        view = mapping.slice_view(data_offset, chunk_sizes, dtype, first, span, lengths, strides)
        if view is not None:
            return span * itemsize, view
    # An accelerator destination is filled by an H2D copy, fastest from pinned memory.
    pin = dest.device.type not in ("cpu", "meta") and _accelerator_available()
    staging = torch.empty(span, dtype=dtype, pin_memory=pin)
    _pread_exact(fd, _buffer(staging), start, path)
    if contiguous:
        source = staging.view(tuple(lengths))
    else:
        source = staging.as_strided(tuple(lengths), tuple(strides))
    copy_into(dest, source)
    return span * itemsize, None


def span_from_strides(strides: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int, bool]:
    """``core.chunks.slice_span`` given the chunk's row-major strides (computed once per
    chunk by the caller): the same result, in C-level builtins (it runs once per read)."""
    if 0 in lengths:
        return 0, 0, True
    first = sum(map(mul, offsets, strides))
    span = sum(map(mul, map(sub, lengths, _ONES[:len(lengths)]), strides)) + 1
    return first, span, span == prod(lengths)


_ONES = (1,) * 64


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_wide(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``copy_into``, as 8-byte words where both sides' rows allow it: the strided copy of
    a column slice moves 12 % faster (32 MiB of bf16 rows of 1 KiB: 7.9 vs 8.9 ms)."""
    if dest.dtype == source.dtype and dest.dtype.itemsize < 8 and dest.device.type == "cpu":
        try:
            wide_dest, wide_source = dest.view(torch.int64), source.view(torch.int64)
        except RuntimeError:  # rows not a multiple of 8 bytes, or not 8-byte aligned
            pass
        else:
            wide_dest.copy_(wide_source)
            return
    copy_into(dest, source)


def copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``, casting when the dtypes differ; a same-dtype copy goes bit
    for bit through an integer view (``copy_`` has no kernel for ``bits16``, ``float4``,
    sub-byte ints, ... and the view keeps NaN payloads)."""
    view = _BITS.get(dest.dtype.itemsize) if dest.dtype == source.dtype and dest.dtype not in _BITS.values() else None
    if view is not None and dest.device.type != "meta":
        dest.view(view).copy_(source.view(view))
    else:
        dest.copy_(source)


# dtypes whose same-dtype ``copy_`` is a plain bit copy on every device (the others go
# through ``copy_into``'s integer view).  Not bool: its copy stores every non-zero byte
# as 1, and a checkpoint must give back the bytes it was given.
_PLAIN = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8})


# from this size a copy is worth its two extra views as 8-byte words (``_copy_wide``)
_WIDE_MIN_BYTES = 1 << 20


class PendingCopies:
    """Copies from file mappings into host tensors, done together by ``flush``: pairs of
    one plain dtype below 1 MiB in one ``torch._foreach_copy_`` call, the rest one by one
    (``_copy_wide``).  Sorted as they are added (the reader knows the pair's dtypes and
    size then): a Shard(0) → Shard(1) load of 2000 small tensors adds 4000 pairs per rank.
    ``add_mapped`` and ``add_region`` queue a slice of a mapping before it is viewed, so
    that ``flush`` makes the views of evenly spaced slices of one shape in one call, and
    ``add_region`` takes the destination as memory, so that the slices one tensor
    receives from several files become one copy.  The caller flushes while the mappings
    are open.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the pending copies."""
        self.dests: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.others: list[tuple[torch.Tensor, torch.Tensor]] = []
        # slices of a mapping not viewed yet, by (id of the mapping's typed tensor, shape,
        # strides): that tensor, their element starts and destinations (see add_mapped)
        self.mapped: dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                          tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}
        # runs of add_region calls into one tensor: [tensor, typed source, shape,
        # destination strides, source strides, destination offsets, source starts]
        self.runs: list[list[Any]] = []
        self._run: list[Any] | None = None

    def add_mapped(self, dest: torch.Tensor, mapping: FileMapping, dtype: torch.dtype, start: int,
                   lengths: tuple[int, ...], strides: tuple[int, ...], nbytes: int) -> None:
        """Queue copying the slice of ``mapping`` at element ``start`` of ``typed(dtype)``
        (shape ``lengths``, ``strides``; pages populated: ``FileMapping.slice_start``) into
        the CPU tensor ``dest``.  Slices of one shape are viewed together at ``flush``:
        the chunks of equally sized tensors lie evenly spaced in a file, and one
        ``as_strided`` + ``unbind`` makes all their views (~0.6 us a view instead of
        ~1.3 us; a Shard(0) -> Shard(1) load of 2000 small tensors copies 4000 slices).
        """
        typed = mapping.typed(dtype)
        if dest.dtype is not dtype or dtype not in _PLAIN or nbytes >= _WIDE_MIN_BYTES:
            self.others.append((dest, typed.as_strided(lengths, strides, start)))
            return
        self._source(typed, lengths, strides, start, dest)

    def _source(self, typed: torch.Tensor, lengths: tuple[int, ...], strides: tuple[int, ...], start: int,
                dest: torch.Tensor) -> None:
        key = (id(typed), lengths, strides)  # a tensor's == compares values: keyed by id
        group = self.mapped.get(key)
        if group is None:
            group = self.mapped[key] = (typed, [], [])
        group[1].append(start)
        group[2].append(dest)

    def add_region(self, tensor: torch.Tensor, offset: int, dest_strides: tuple[int, ...], mapping: FileMapping,
                   dtype: torch.dtype, data_offset: int, first: int, span: int, lengths: tuple[int, ...],
                   strides: tuple[int, ...], nbytes: int) -> bool:
        """Queue copying the slice of ``mapping`` that ``FileMapping.slice_start`` names
        (``first``/``span`` elements of the chunk at byte ``data_offset``, shape ``lengths``,
        ``strides``), its pages populated now, into ``tensor.as_strided(lengths,
        dest_strides, offset)`` (a CPU tensor) without making that view now; ``False``
        (nothing queued) where the pages cannot be populated.

        Consecutive regions of one tensor whose offsets and sources are evenly spaced (the
        row blocks of a column slice, each from one rank's file, in a
        :class:`MappingArena`) are copied as one: one view of each side with the block as
        an extra leading dimension.  A Shard(0) -> Shard(1) load of 2000 small tensors on 2
        ranks makes 2000 copies a rank instead of 4000.  One call per read, the populated
        run checked here: the reader's column slices run through it 4000 times a load.
        """
        itemsize = dtype.itemsize
        begin = data_offset + first * itemsize
        if mapping._low <= begin and begin + span * itemsize <= mapping._high and not begin % itemsize:
            start: int | None = (mapping._origin + begin) // itemsize  # inside the populated run
        else:
            start = mapping.slice_start(data_offset, dtype, first, span)
            if start is None:
                return False
        typed = mapping._typed.get(dtype)
        if typed is None:
            typed = mapping.typed(dtype)
        if tensor.dtype is not dtype or dtype not in _PLAIN or nbytes >= _WIDE_MIN_BYTES:
            self.others.append((tensor.as_strided(lengths, dest_strides, offset),
                                typed.as_strided(lengths, strides, start)))
            return True
        run = self._run
        if (run is not None and run[0] is tensor and run[1] is typed and run[2] == lengths and run[3] == dest_strides
                and run[4] == strides):
            run[5].append(offset)
            run[6].append(start)
        else:
            self._run = run = [tensor, typed, lengths, dest_strides, strides, [offset], [start]]
            self.runs.append(run)
        return True

    def _view_runs(self) -> None:
        """Turn the runs of ``add_region`` into destination views: one for each stretch of
        a run whose regions are evenly spaced on both sides, one for each region left."""
        for tensor, typed, lengths, dest_strides, strides, offsets, starts in self.runs:
            count = len(offsets)
            i = 0
            while i < count:
                j = i + 1
                if j < count:
                    step, source_step = offsets[j] - offsets[i], starts[j] - starts[i]
                    if (step > 0 and source_step > 0) or (step < 0 and source_step < 0):
                        j += 1
                        while j < count and offsets[j] - offsets[j - 1] == step and starts[j] - starts[j - 1] == source_step:
                            j += 1
                if j - i == 1:
                    self._source(typed, lengths, strides, starts[i],
                                 tensor.as_strided(lengths, dest_strides, offsets[i]))
                else:
                    # regions i..j-1 as one: the lowest first (as_strided takes no
                    # negative stride), each side's block order the same
                    low = i if step > 0 else j - 1
                    self._source(typed, (j - i, *lengths), (abs(source_step), *strides), starts[low],
                                 tensor.as_strided((j - i, *lengths), (abs(step), *dest_strides), offsets[low]))
                i = j

    def add(self, dest: torch.Tensor, source: torch.Tensor, nbytes: int) -> None:
        """Queue ``copy_into(dest, source)``; both on the CPU, ``nbytes`` the bytes copied."""
        dtype = dest.dtype
        if dtype is source.dtype and dtype in _PLAIN and nbytes < _WIDE_MIN_BYTES:
            self.dests.append(dest)
            self.sources.append(source)
        else:
            self.others.append((dest, source))

    def flush(self) -> None:
        """Perform the pending copies."""
        if self.runs:
            self._view_runs()
        dests, sources, others, mapped = self.dests, self.sources, self.others, self.mapped
        self.clear()
        for (_, lengths, strides), (typed, starts, targets) in mapped.items():
            count, step = len(starts), starts[-1] - starts[0]
            if count > 1 and step > 0 and step % (count - 1) == 0 and starts == list(
                    range(starts[0], starts[-1] + 1, step // (count - 1))):
                # evenly spaced (the same slice of equally sized chunks in file order)
                sources.extend(typed.as_strided((count, *lengths), (step // (count - 1), *strides),
                                                starts[0]).unbind(0))
            else:
                sources.extend(typed.as_strided(lengths, strides, start) for start in starts)
            dests.extend(targets)
        if dests:
            torch._foreach_copy_(dests, sources)
        for dest, source in others:
            _copy_wide(dest, source)


def copy_many(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``copy_into(d, s)`` for every pair; pairs of one plain dtype in one
    ``torch._foreach_copy_`` call (one dispatch for the batch instead of ~2 us a copy:
    a Shard(0) → Shard(1) load of 2000 small tensors copies 4000 column slices)."""
    pending = PendingCopies()
    for dest, source in zip(dests, sources):
        if dest.is_cpu and source.is_cpu:
            pending.add(dest, source, source.numel() * source.element_size())
        else:
            _copy_wide(dest, source)
    pending.flush()
