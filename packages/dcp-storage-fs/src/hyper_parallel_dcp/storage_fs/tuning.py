"""Every internal size and threshold of the filesystem backend, in one place.

Users tune ``core.settings`` (``HP_DCP_FILES_KEPT``, ``HP_DCP_ALIGNED_WRITES``); these are
the constants behind them, each with its unit.  The measurements that set them are in
``docs/perf/storage.md``.
"""

from __future__ import annotations

__all__ = [
    "AHEAD_MAX_BYTES",
    "ARENA_MAX_BYTES",
    "BATCH_BYTES",
    "BATCH_ITEMS",
    "BLOCK_SHIFT",
    "BOUNCE_MIN_BYTES",
    "FOLIO_ALIGN",
    "IOV_MAX_BUFFERS",
    "LARGE_FOLIO",
    "PINNED_BUFFER_BYTES",
    "PREADV_MAX_BYTES",
    "READ_SPLIT_BYTES",
    "READ_THREADS",
    "SMALL_FOLIO",
    "VERIFY_BLOCK_BYTES",
    "WIDE_COPY_MIN_BYTES",
]

#: bytes per ``preadv`` call (Linux caps one call near 2 GiB)
PREADV_MAX_BYTES = 1 << 30
#: buffers per ``preadv`` / ``writev`` call (below Linux's ``IOV_MAX`` of 1024)
IOV_MAX_BUFFERS = 512

#: a read stream completes and yields its reads in batches of this many reads or bytes
BATCH_ITEMS = 256
BATCH_BYTES = 32 << 20

#: pages of a file mapping are populated a block of ``1 << BLOCK_SHIFT`` bytes at a time
BLOCK_SHIFT = 20
#: a forward walk through a mapping populates up to this far ahead of the slice it reads
AHEAD_MAX_BYTES = 32 << 20
#: the most address space a reader reserves for its files' mappings
ARENA_MAX_BYTES = 1 << 42
#: arena slots start on this boundary (a huge page on x86-64, the largest folio a save makes)
FOLIO_ALIGN = 2 << 20
#: from this size a same-dtype host copy goes as 8-byte words, one by one
WIDE_COPY_MIN_BYTES = 1 << 20

#: the one page-locked host buffer that device reads and device writes go through
PINNED_BUFFER_BYTES = 64 << 20
#: a device read batch larger than this is filled by ``READ_THREADS`` threads
READ_SPLIT_BYTES = 4 << 20
READ_THREADS = 4
#: a device chunk of at least this size is written through the pinned buffer
BOUNCE_MIN_BYTES = 1 << 20

#: a save's file data goes out in writes that end on multiples of this ...
LARGE_FOLIO = 2 << 20
#: ... or of this where 2 MiB folios are costly (``host_memory.large_folio_writes``)
SMALL_FOLIO = 256 << 10

#: bytes hashed per read by ``verify_checkpoint``
VERIFY_BLOCK_BYTES = 16 << 20
