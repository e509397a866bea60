"""``ObjectStoreReader``: the filesystem reader's read path over ranged GETs, many in flight.

Locating a chunk, the region and size checks, ``verify``, batching, staging, streaming and
the error texts are ``storage_fs.reader.FileSystemReader``'s; this module supplies the
transport, an object as the reader's file (:class:`_Object`).  Reads back to back in one
object share a GET (``AdjacentReads``), a range is split at ``range_size`` over
``read_concurrency`` threads and fetched straight into the destination when it is a
contiguous CPU tensor of the stored dtype, else into a staging buffer, one range per run
of a strided slice (``storage_fs.sinks.byte_runs``: S3 serves one range per GET).  The GETs
of a batch (up to ``_WINDOW_BYTES``) land together.  Object sizes are checked against
``.metadata`` on every response.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
from typing import Any, Optional, Union

import xxhash

from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.storage_fs.compression import CompressedFiles
from hyper_parallel_dcp.storage_fs.incremental import missing_file_error
from hyper_parallel_dcp.storage_fs.metadata_io import StoredMetadata
from hyper_parallel_dcp.storage_fs.reader import FileSystemReader, check_size
from hyper_parallel_dcp.storage_fs.safetensors_header import HeaderEntry, SafetensorsHeaderError, read_header

from .client import ObjectStore, ObjectStoreSettings
from .files import ObjectFiles

__all__ = ["READ_OVERHEAD", "ObjectStoreReader"]

#: Extra bytes a read may fetch (as a fraction of the bytes it needs) to merge the runs
#: of a strided slice into fewer requests (S3 serves one range per GET).
READ_OVERHEAD = 0.1
#: Bytes (or reads) of a batch, whose GETs are in flight together.
_WINDOW_BYTES = 512 << 20
_WINDOW_READS = 1 << 14


class _Object:
    """An object of the checkpoint as the reader's file: :meth:`read_into` starts ranged GETs
    that land at :meth:`ObjectStoreReader.land_reads`.  Its header is read only by ``verify``
    (``trusted``: chunks are located from ``.metadata``'s columns, no request per object)."""

    fd = None  # no descriptor: a read into an accelerator goes through staging
    mapped = None
    trusted = True
    gap_overhead = READ_OVERHEAD
    lands_later = True

    def __init__(self, reader: ObjectStoreReader, name: str) -> None:
        self.reader, self.stored_name = reader, name
        self.name = reader.checkpoint_files().where(name)
        self._starts: list[int] = []  # the chunks verify fetched, by start, until the batch lands
        self._held: list[memoryview] = []
        self._header: Optional[dict[str, HeaderEntry]] = None

    def read_into(self, start: int, buffers: list[memoryview]) -> None:
        """Start filling ``buffers`` in turn from the bytes at ``start`` (from a chunk verify
        holds, else with GETs of the ranges left, a GET for each run of buffers)."""
        runs: list[list[Any]] = []  # [start, buffers, end]
        for buffer in buffers:
            held = self._held_at(start, len(buffer))
            if held is not None:
                buffer[:] = held
            elif runs and runs[-1][2] == start:
                runs[-1][1].append(buffer)
                runs[-1][2] += len(buffer)
            else:
                runs.append([start, [buffer], start + len(buffer)])
            start += len(buffer)
        for begin, views, _ in runs:
            self.reader._start_gets(self.stored_name, begin, views)

    def _held_at(self, start: int, length: int) -> Optional[memoryview]:
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + length > self._starts[i] + len(self._held[i]):
            return None
        return self._held[i][start - self._starts[i]:start - self._starts[i] + length]

    def hash_range(self, offset: int, length: int) -> str:
        """xxh3-64 of the bytes ``[offset, offset + length)``, fetched whole and held for the
        reads of this batch (a chunk verify checks is fetched once)."""
        data = memoryview(bytearray(length))
        for future in self.reader._start_gets(self.stored_name, offset, [data], wait=True):
            future.result()
        i = bisect.bisect_right(self._starts, offset)
        self._starts.insert(i, offset)
        self._held.insert(i, data)
        self.reader._holding.append(self)
        return xxhash.xxh3_64_hexdigest(data)

    def header(self) -> dict[str, HeaderEntry]:
        """The parsed header, read once (by ``verify`` only); raises
        :class:`CorruptCheckpointError` naming the object, or as :meth:`read_range`."""
        if self._header is None:
            files = self.reader.checkpoint_files()
            try:
                with files.open(self.stored_name) as f:
                    self._header = read_header(f, files.size(self.stored_name) or 0)
            except FileNotFoundError:
                raise missing_file_error(self.name, self.stored_name) from None
            except SafetensorsHeaderError as exc:
                raise CorruptCheckpointError(f"checkpoint file {self.name} is not a valid safetensors file: "
                                             f"{exc}") from None
        return self._header

    def mapping(self, arena: Any) -> None:
        """No mapping: a strided slice goes through a staging buffer."""

    def close(self) -> None:
        self._starts, self._held = [], []


class ObjectStoreReader(FileSystemReader):
    """Reads a checkpoint from ``s3://bucket/prefix`` with ranged GETs; ``verify`` checks the
    xxh3 of each chunk a read touches.  ``bytes_read`` counts the bytes the reads fetch (as
    the filesystem reader's), ``requests`` the GETs."""

    batch_items, batch_bytes = _WINDOW_READS, _WINDOW_BYTES

    def __init__(self, url: Union[str, None] = None, *, verify: bool = False,
                 settings: Optional[ObjectStoreSettings] = None) -> None:
        super().__init__(None, verify=verify)
        self.settings = settings or ObjectStoreSettings()
        self.files: Optional[ObjectFiles] = None if url is None else ObjectFiles(str(url), self.settings)
        self.requests = 0
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._gets: list[cf.Future] = []  # of the reads started, not landed
        self._holding: list[_Object] = []  # objects holding chunks verify fetched

    def __getstate__(self) -> dict[str, Any]:
        # threads, locks and reads in flight are this process's: made again after unpickling
        return {**self.__dict__, "_pool": None, "_gets": [], "_holding": [], "compressed": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.compressed = CompressedFiles()

    def reset(self, checkpoint_id: Union[str, Any, None] = None) -> None:
        if checkpoint_id is not None:
            self.files = ObjectFiles(str(checkpoint_id), self.settings)
        super().reset()
        self.requests = 0

    @property
    def url(self) -> Optional[str]:
        return None if self.files is None else str(self.files.target)

    def location(self) -> Optional[str]:
        return self.url

    def checkpoint_files(self) -> ObjectFiles:
        if self.files is None:
            raise ValueError("ObjectStoreReader has no checkpoint URL: pass checkpoint_id or a URL")
        return self.files

    def metadata_from_payload(self, payload: StoredMetadata) -> Metadata:
        """Parse the coordinator's bytes (every rank sees the same bucket: nothing to check)."""
        self.metadata = payload.parse(self.checkpoint_files())
        self._is_global = payload.is_global
        return self.metadata

    def reads_are_copies(self) -> bool:
        return False

    def open_file(self, name: str) -> _Object:
        return _Object(self, name)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """One ranged GET of exactly ``[offset, offset + length)`` of object ``name``."""
        blob = memoryview(bytearray(length))
        if length:
            self._get(name, offset, [blob])
            self.requests += 1
        return bytes(blob)

    def _start_gets(self, name: str, start: int, views: list[memoryview], wait: bool = False) -> list[cf.Future]:
        """Submit GETs of ``views``' bytes of object ``name`` from ``start``, at most
        ``range_size`` each; their futures, awaited by :meth:`land_reads` unless ``wait``."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.settings.read_concurrency, thread_name_prefix="hp-dcp-get")
        step, futures, size = self.settings.range_size, [], 0
        piece: list[memoryview] = []
        for view in views:
            for at in range(0, len(view), step):
                part = view[at:at + step]
                if piece and size + len(part) > step:
                    futures.append(self._pool.submit(self._get, name, start - size, piece))
                    piece, size = [], 0
                piece.append(part)
                size += len(part)
                start += len(part)
        if piece:
            futures.append(self._pool.submit(self._get, name, start - size, piece))
        self.requests += len(futures)
        if not wait:
            self._gets += futures
        return futures

    def _get(self, name: str, start: int, views: list[memoryview]) -> None:
        """One ranged GET filling ``views`` in turn; checks the object's size against ``.metadata``."""
        files = self.checkpoint_files()
        into = views[0] if len(views) == 1 else memoryview(bytearray(sum(map(len, views))))
        try:
            total = files.store.get_range_into(files.key(name), start, into)
        except CheckpointNotFoundError:
            raise missing_file_error(files.where(name), name) from None
        check_size(files.where(name), total, (self.metadata.files if self.metadata else {}).get(name))
        if into is not views[0]:
            at = 0
            for view in views:
                view[:] = into[at:at + len(view)]
                at += len(view)

    def land_reads(self, drop: bool = False) -> None:
        gets, self._gets = self._gets, []
        for held in self._holding:
            held.close()
        self._holding = []
        try:
            for future in gets:
                if drop:
                    future.cancel()
                else:
                    future.result()
        finally:
            for future in gets:
                future.cancel()
            cf.wait(gets)  # no GET writes into a buffer after this returns

    @property
    def store(self) -> Optional[ObjectStore]:
        return None if self.files is None else self.files.store
