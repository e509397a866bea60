"""Checkpoint files mapped read-only, the source of column-slice copies:
:class:`FileMapping` (pages populated ahead of the reads), :class:`MappingArena` (files
in equal slots of one reservation) and :func:`wait_for_unmaps`."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
from typing import Optional

import torch

from . import posix

__all__ = ["FileMapping", "MappingArena", "wait_for_unmaps"]

BLOCK_SHIFT = 20  # pages are populated a block of 1 << BLOCK_SHIFT bytes at a time
AHEAD_MAX_BYTES = 32 << 20  # a forward walk populates up to this far ahead of the slice it reads
FOLIO_ALIGN = 2 << 20  # arena slots start on this boundary (a huge page, the largest folio a save makes)


def _new_unmapper() -> cf.ThreadPoolExecutor:
    return cf.ThreadPoolExecutor(1, thread_name_prefix="hp-dcp-unmap")


#: unmaps closed mappings (with no views left) off the load's path, in order (ctypes releases the GIL)
_UNMAPPER = _new_unmapper()


def _forked() -> None:  # a forked child has no unmapping thread
    global _UNMAPPER
    _UNMAPPER = _new_unmapper()


os.register_at_fork(after_in_child=_forked)


def wait_for_unmaps() -> None:
    """Block until every closed :class:`FileMapping` and :class:`MappingArena` is unmapped."""
    _UNMAPPER.submit(int).result()  # one thread, in order: every earlier unmap is done


def _bytes_at(addr: int, size: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=torch.uint8)


class MappingArena:
    """One address-space reservation holding a reader's files in equal ``FOLIO_ALIGN`` slots,
    so that a column slice's row blocks lie evenly spaced (copied as one)."""

    def __init__(self, base: int, slot_bytes: int, slots: int, reserved: tuple[int, int]) -> None:
        self.base = base
        self.slot_bytes = slot_bytes
        self.size = slot_bytes * slots
        self._reserved = reserved  # (address, size) of the whole reservation, which may begin below base
        self.data: Optional[torch.Tensor] = _bytes_at(base, self.size)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._free = list(range(slots - 1, -1, -1))  # taken from the end: slot 0 first

    @classmethod
    def reserve(cls, slot_bytes: int, slots: int) -> Optional[MappingArena]:
        """An arena of ``slots`` slots of at least ``slot_bytes`` each, or ``None`` if refused."""
        if slot_bytes <= 0 or slots <= 0:
            return None
        slot_bytes = -(-slot_bytes // FOLIO_ALIGN) * FOLIO_ALIGN
        size = slot_bytes * slots + FOLIO_ALIGN  # room to move the start to a boundary
        addr = posix.reserve(size)
        if addr is None:
            return None
        return cls(-(-addr // FOLIO_ALIGN) * FOLIO_ALIGN, slot_bytes, slots, (addr, size))

    def place(self, fd: int, size: int) -> Optional[tuple[int, int]]:
        """Map the file ``fd`` (``size`` bytes) in a free slot: ``(slot, address)``, or ``None``."""
        if self.data is None or not self._free or size > self.slot_bytes:
            return None
        slot = self._free[-1]
        addr = self.base + slot * self.slot_bytes
        if posix.map_file(fd, size, at=addr) is None:
            # a failed MAP_FIXED may have unmapped the slot: reserve it again or give up
            if posix.reserve(self.slot_bytes, at=addr) is None:
                self._free.clear()
            return None
        self._free.pop()
        return slot, addr

    def release(self, slot: int) -> None:
        """Free ``slot`` (its file stays mapped until the next file replaces it)."""
        if self.data is not None:
            self._free.append(slot)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole reservation viewed as ``dtype`` (only slots holding a file are read)."""
        typed = self._typed.get(dtype)
        if typed is None:
            assert self.data is not None
            typed = self._typed[dtype] = self.data[:self.size - self.size % dtype.itemsize].view(dtype)
        return typed

    def close(self) -> None:
        """Drop the views and unmap every file in the arena (not to be used afterwards)."""
        if self.data is not None:
            self.data = None
            self._typed.clear()
            self._free.clear()
            _UNMAPPER.submit(posix.unmap, *self._reserved)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class FileMapping:
    """A whole file mapped read-only and shared; views are used before :meth:`close`."""

    def __init__(self, fd: int, size: int, arena: Optional[MappingArena] = None) -> None:
        self.size = size
        self._fd = fd
        self._addr: Optional[int] = None
        self._data: Optional[torch.Tensor] = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # a slice is then one as_strided
        self._populated = bytearray((size >> BLOCK_SHIFT) + 1)  # per block: pages populated
        self._low = self._high = 0  # the latest run of populated blocks, as a byte range
        self._arena: Optional[MappingArena] = None
        self._slot = -1
        self._origin = 0  # where the file starts in typed()'s bytes
        if not posix.MAPPING or size == 0:
            return
        placed = None if arena is None else arena.place(fd, size)
        if placed is not None:
            assert arena is not None
            self._slot, self._addr = placed
            self._arena, self._origin, self._data = arena, self._addr - arena.base, arena.data
            return
        self._addr = posix.map_file(fd, size)
        if self._addr is not None:
            self._data = _bytes_at(self._addr, size)

    @classmethod
    def open(cls, fd: int, size: int, arena: Optional[MappingArena] = None) -> Optional[FileMapping]:
        """The file ``fd`` (``size`` bytes) mapped, in ``arena`` if it has a free slot; ``None`` if refused."""
        mapping = cls(fd, size, arena)
        return mapping if mapping._data is not None else None

    def slice_at(self, data_offset: int, dtype: torch.dtype, first: int, span: int
                 ) -> Optional[tuple[torch.Tensor, int]]:
        """Populate a stored slice's pages: ``(typed(dtype), its first element)``; ``None``
        when refused, past the end of the file, or not aligned to the element size."""
        itemsize = dtype.itemsize
        start = data_offset + first * itemsize
        end = start + span * itemsize
        if start % itemsize:
            return None  # a view would need a copy
        if not (self._low <= start and end <= self._high):  # outside the populated run
            if end > self.size or not self._populate(start, end):
                return None
        typed = self._typed.get(dtype)
        return (self.typed(dtype) if typed is None else typed), (self._origin + start) // itemsize

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The mapping viewed as ``dtype`` (in an arena: the whole arena)."""
        typed = self._typed.get(dtype)
        if typed is None:
            if self._arena is not None:
                typed = self._typed[dtype] = self._arena.typed(dtype)
            else:
                assert self._data is not None
                typed = self._typed[dtype] = self._data[:self.size - self.size % dtype.itemsize].view(dtype)
        return typed

    def _populate(self, start: int, end: int) -> bool:
        """Populate the blocks ``[start, end)`` touches in one call, and ahead while reads
        walk forwards (up to ``AHEAD_MAX_BYTES``); ``False`` when the kernel refuses."""
        populated = self._populated
        end_block = ((end - 1) >> BLOCK_SHIFT) + 1
        first_block = populated.find(0, start >> BLOCK_SHIFT, end_block)
        last_block = end_block - 1
        if first_block >= 0:
            last_block = populated.rfind(0, first_block, end_block)
            if self._high and first_block << BLOCK_SHIFT == self._high:  # the walk goes on
                ahead = min(max(self._high - self._low, 1 << BLOCK_SHIFT), AHEAD_MAX_BYTES) >> BLOCK_SHIFT
                limit = min(last_block + 1 + ahead, len(populated))
                taken = populated.find(1, last_block + 1, limit)
                last_block = (limit if taken < 0 else taken) - 1
            block_start = first_block << BLOCK_SHIFT
            length = min((last_block + 1) << BLOCK_SHIFT, self.size) - block_start
            assert self._addr is not None
            # a failed read from disk is then an error here, not a SIGBUS in the copy
            if not posix.cached(self._fd, block_start, length) and \
                    not posix.populate_read(self._addr + block_start, length):
                return False
            populated[first_block:last_block + 1] = b"\x01" * (last_block + 1 - first_block)
        # the populated run, so that the next slice inside it skips the lookups
        low = (start >> BLOCK_SHIFT) << BLOCK_SHIFT
        high = min((last_block + 1) << BLOCK_SHIFT, self.size)
        if low <= self._high and high >= self._low:
            self._low, self._high = min(low, self._low), max(high, self._high)
        else:
            self._low, self._high = low, high
        return True

    def close(self) -> None:
        """Drop the views and unmap, on the unmapping thread (in an arena: free the slot)."""
        if self._addr is not None:
            self._data = None
            self._typed.clear()
            if self._arena is not None:
                self._arena.release(self._slot)
                self._arena = None
            else:
                _UNMAPPER.submit(posix.unmap, self._addr, self.size)
            self._addr = None
            self._low = self._high = 0

    def __del__(self) -> None:
        # a reader dropped without reset() must not keep a deleted checkpoint's disk space
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
