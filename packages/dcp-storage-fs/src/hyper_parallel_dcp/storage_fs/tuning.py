"""Every internal size and threshold of the filesystem backend, each with its unit (users
tune ``core.settings``; the measurements are in ``docs/perf/storage.md``)."""

from __future__ import annotations

__all__ = ["AHEAD_MAX_BYTES", "ARENA_MAX_BYTES", "BATCH_BYTES", "BATCH_ITEMS", "BLOCK_SHIFT", "BOUNCE_MIN_BYTES",
           "COPY_ALONE_MIN_BYTES", "FOLIO_ALIGN", "IOV_MAX_BUFFERS", "LARGE_FOLIO", "PINNED_BUFFER_BYTES",
           "PREADV_MAX_BYTES", "READ_SPLIT_BYTES", "READ_THREADS", "SMALL_FOLIO", "VERIFY_BLOCK_BYTES"]

#: bytes per ``preadv`` call (Linux caps one call near 2 GiB)
PREADV_MAX_BYTES = 1 << 30
#: buffers per ``preadv`` / ``writev`` call (below Linux's ``IOV_MAX`` of 1024)
IOV_MAX_BUFFERS = 512

#: a read stream completes and yields its reads in batches of this many reads or bytes
BATCH_ITEMS = 256
BATCH_BYTES = 32 << 20

# file mappings (``mapping``) and the copies out of them (``sinks``)
BLOCK_SHIFT = 20  # pages are populated a block of 1 << BLOCK_SHIFT bytes at a time
AHEAD_MAX_BYTES = 32 << 20  # a forward walk populates up to this far ahead of the slice it reads
ARENA_MAX_BYTES = 1 << 42  # the most address space a reader reserves for its files' mappings
FOLIO_ALIGN = 2 << 20  # arena slots start on this boundary (a huge page, the largest folio a save makes)
COPY_ALONE_MIN_BYTES = 1 << 20  # from this size a host copy goes alone, not in the batched _foreach_copy_

# accelerator memory: the one page-locked host buffer device reads and writes go through
PINNED_BUFFER_BYTES = 64 << 20
READ_SPLIT_BYTES = 4 << 20  # a device read batch larger than this is filled by READ_THREADS threads
READ_THREADS = 4
BOUNCE_MIN_BYTES = 1 << 20  # a device chunk of at least this size is written through the buffer

# a save's file data goes out in writes that end on multiples of LARGE_FOLIO, or of
# SMALL_FOLIO where 2 MiB folios are costly (``host_memory.large_folio_writes``)
LARGE_FOLIO = 2 << 20
SMALL_FOLIO = 256 << 10

#: bytes hashed per read by ``verify_checkpoint``
VERIFY_BLOCK_BYTES = 16 << 20
