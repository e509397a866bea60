"""A storage bandwidth cap shared by every reading process: stands in for shared storage.

:class:`SharedBandwidth` is a virtual-time token bucket kept in a small file: a read of
``n`` bytes reserves the next ``n / bytes_per_s`` seconds of the one shared "link" under
``flock`` and sleeps until its slot ends, so N processes together never exceed the cap.
It models a link of fixed bandwidth shared by the ranks: it charges bytes, not calls (a
slot starts when its read did, so the read's own work overlaps its transfer, and a read
split into many calls costs what one of the same bytes costs).
:class:`ThrottledFileSystemReader` charges every byte the reader takes from storage
(``bytes_read``) to it: a compressed chunk's bytes as its read-ahead thread reads them (the
link busy while the reader decodes), the rest a batch of reads at a time (what one merged
``preadv`` or mapped copy moves, charged once it is done) and per object; pass it to
``load(..., storage_reader=...)``.
:class:`ThrottledFileSystemWriter` charges each data-file write to it as it happens (what
a save's file bytes through a link cost; the writer's compression threads go on meanwhile);
pass it to ``save(..., storage_writer=...)``.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from hyper_parallel_dcp.core.planner import ReadItem
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter

__all__ = ["SharedBandwidth", "ThrottledFileSystemReader", "ThrottledFileSystemWriter"]

_SLOT = struct.Struct("d")


class SharedBandwidth:
    """``bytes_per_s`` shared through ``state_file`` by every process that opens it."""

    def __init__(self, state_file: Union[str, os.PathLike], bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s}")
        self.state_file = Path(state_file)
        self.bytes_per_s = float(bytes_per_s)
        self.state_file.touch(exist_ok=True)

    def consume(self, nbytes: int, since: Optional[float] = None) -> float:
        """Block until ``nbytes`` fit under the shared cap (the transfer starting at ``since``,
        a ``time.time()``, or now, once the link is free); returns the seconds waited."""
        if nbytes <= 0:
            return 0.0
        with open(self.state_file, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                raw = f.read(_SLOT.size)
                free_at = _SLOT.unpack(raw)[0] if len(raw) == _SLOT.size else 0.0
                now = time.time() if since is None else since
                end = max(now, free_at) + nbytes / self.bytes_per_s
                f.seek(0)
                f.write(_SLOT.pack(end))
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        wait = end - time.time()
        if wait > 0:
            time.sleep(wait)
        return max(0.0, wait)


class ThrottledFileSystemReader(FileSystemReader):
    """A :class:`FileSystemReader` whose every storage byte passes the shared cap."""

    def __init__(self, path: Union[str, os.PathLike, None], bandwidth: SharedBandwidth, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.bandwidth = bandwidth
        self.throttled_s = 0.0
        self._owed = 0  # bytes of the reads in progress
        self._since: Optional[float] = None  # when the first of them began
        self.compressed.fetch = self._fetch

    def _fetch(self, fd: int, length: int, offset: int) -> bytes:
        started = time.time()
        data = os.pread(fd, length, offset)
        self.throttled_s += self.bandwidth.consume(len(data), started)
        return data

    def reads_are_copies(self) -> bool:
        return False  # it stands in for storage outside the host, page cache or not

    def _read_many(self, reads: Iterable[Any]) -> None:
        before, since = self.bytes_read - self.compressed.bytes_read, time.time()
        try:
            super()._read_many(reads)
        finally:  # owed until the reads are done: their slot begins when the first began
            # (a compressed chunk's bytes are charged by ``_fetch`` as they are read)
            self._owed += self.bytes_read - self.compressed.bytes_read - before
            self._since = since if self._since is None else self._since

    def _finish_pending(self) -> None:
        try:
            super()._finish_pending()
        finally:
            since, owed, self._since, self._owed = self._since, self._owed, None, 0
            self.throttled_s += self.bandwidth.consume(owed, since)

    def read_object_bytes(self, item: ReadItem) -> tuple[bytes, str]:
        before, started = self.bytes_read, time.time()
        found = super().read_object_bytes(item)
        self.throttled_s += self.bandwidth.consume(self.bytes_read - before, started)
        return found


class _ThrottledFile:
    """A file whose ``write`` calls pass the cap; other bytes (written through its
    descriptor) pass it when the file is done (:meth:`charge_rest`)."""

    def __init__(self, f: Any, bandwidth: SharedBandwidth) -> None:
        self._f, self._bandwidth, self.charged = f, bandwidth, 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self.charged += n
        self._bandwidth.consume(n)
        return n

    def charge_rest(self) -> None:
        self._f.flush()
        self._bandwidth.consume(os.fstat(self._f.fileno()).st_size - self.charged)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class ThrottledFileSystemWriter(FileSystemWriter):
    """A :class:`FileSystemWriter` whose every data-file byte passes the shared cap as it is written."""

    def __init__(self, path: Union[str, os.PathLike, None], bandwidth: SharedBandwidth, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.bandwidth = bandwidth

    def data_writer(self, write: Any) -> Any:
        def throttled(f: Any) -> None:
            wrapped = _ThrottledFile(f, self.bandwidth)
            write(wrapped)
            wrapped.charge_rest()
        return throttled
