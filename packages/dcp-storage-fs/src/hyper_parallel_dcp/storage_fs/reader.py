"""``FileSystemReader``: each read item's slice straight from its file into its destination.

The one read path of every file backend: locating a chunk and checking it against
``.metadata``, ``verify``, batching, staging and streaming.  Storage is reached through the
files :meth:`FileSystemReader.open_file` opens (``read_into(start, buffers)``, ``hash_range``,
``mapping``) and :meth:`~FileSystemReader.read_range`; the object-store reader replaces
those with ranged GETs.  Exports :class:`FileSystemReader`, :class:`ChunkLocator`,
:data:`StoredChunk` and :func:`check_size`."""

from __future__ import annotations

import math
import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import ChunkLocation, Metadata, MetadataIndex, StorageInfo, chunk_locator
from hyper_parallel_dcp.core.objects import deserialize_object
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.settings import FILES_KEPT
from hyper_parallel_dcp.core.storage import ReadDestination, StorageReader, read_items

from .compression import CompressedFiles
from .files import CheckpointFiles, LocalFiles
from .incremental import missing_file_error
from .layout import METADATA_FILE
from .mapping import FileMapping, MappingArena
from .metadata_io import (
    StoredMetadata,
    check_region,
    chunk_sizes,
    load_checkpoint_metadata,
    read_stored_metadata,
    storage_entry,
)
from .posix import cached
from .safetensors_header import (
    HeaderEntry,
    SafetensorsHeaderError,
    entry_mismatch,
    header_digest,
    header_layout,
    parse_header,
    read_header_bytes,
)
from .sinks import AdjacentReads, DeviceReads, PendingCopies, PosixFile, read_slice_into

__all__ = ["ChunkLocator", "FileSystemReader", "StoredChunk", "check_size"]

#: a read stream completes and yields its reads in batches of this many reads or bytes
BATCH_ITEMS = 256
BATCH_BYTES = 32 << 20
ARENA_MAX_BYTES = 1 << 42  # the most address space a reader reserves for its files' mappings

#: a stored chunk's checked location: (file, first data byte, shape, row-major strides, dtype)
StoredChunk = tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype]
_Geometry = tuple[int, int, bool, int]  # a slice's (first element, elements spanned, contiguous, elements)
# where a read goes: (destination or None for an object, None, ()), or a region's (tensor, offset, strides)
_Region = tuple[Any, Optional[int], tuple[int, ...]]


def check_size(where: str, size: int, expected: Optional[int]) -> None:
    """:class:`CorruptCheckpointError` naming file ``where`` unless its ``size`` is the
    ``expected`` one ``.metadata`` records (``None``: not recorded)."""
    if expected is not None and size != expected:
        raise CorruptCheckpointError(f"checkpoint file {where} has {size} bytes but the metadata records "
                                     f"{expected} (truncated or replaced)")


class _OpenFile(PosixFile):
    """An open shard file and its header; ``trusted``: the header matches ``.metadata``'s digest."""

    def __init__(self, path: Path, expected_size: Optional[int], digest: Optional[str], stored_name: str = "") -> None:
        self.path = path
        try:
            self.fobj = open(path, "rb")
        except FileNotFoundError:
            raise missing_file_error(str(path), stored_name) from None
        super().__init__(self.fobj.fileno(), str(path))
        try:
            self.size = os.fstat(self.fd).st_size
            check_size(self.name, self.size, expected_size)
            try:
                self._raw_header: Optional[bytes] = read_header_bytes(self.fobj, self.size)
            except SafetensorsHeaderError as exc:
                raise CorruptCheckpointError(f"checkpoint file {path} is not a valid safetensors file: {exc}") from None
            self.trusted = digest is not None and header_digest(self._raw_header, self.size) == digest
            self._header: Optional[dict[str, HeaderEntry]] = None
            self._map: Optional[mmap.mmap] = None
            self.mapped: Optional[FileMapping] = None  # once mapping() has made it
            self._mapping_tried = False
            if not self.trusted:
                self.header()  # a malformed header fails at open
        except BaseException:
            self.fobj.close()
            raise

    def header(self) -> dict[str, HeaderEntry]:
        """The parsed header (parsed once); raises :class:`CorruptCheckpointError` naming the file."""
        if self._header is None:
            assert self._raw_header is not None
            try:
                self._header = parse_header(self._raw_header, self.size)
            except SafetensorsHeaderError as exc:
                raise CorruptCheckpointError(f"checkpoint file {self.path} is not a valid safetensors file: "
                                             f"{exc}") from None
            self._raw_header = None
        return self._header

    def mapping(self, arena: Callable[[], Optional[MappingArena]]) -> Optional[FileMapping]:
        """The file mapped (in a slot of ``arena()`` if free), made once; ``None`` if it cannot be."""
        if not self._mapping_tried:
            self._mapping_tried = True
            self.mapped = FileMapping.open(self.fd, self.size, arena())
        return self.mapped

    def hash_range(self, offset: int, length: int) -> str:
        """xxh3-64 of the file's bytes ``[offset, offset + length)``."""
        if length == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        if self._map is None:
            self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        with memoryview(self._map) as view, view[offset:offset + length] as part:
            return xxhash.xxh3_64_hexdigest(part)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        self.fobj.close()


class ChunkLocator:
    """Where each stored tensor chunk of ``metadata`` is, and each slice's geometry: from the
    metadata's columns when the file's header is trusted, else from its storage entry,
    checked against the header and (``verify``) hashed once (``verified``)."""

    def __init__(self, metadata: Metadata, root: str, verify: bool, verified: set[MetadataIndex]) -> None:
        self.metadata = metadata
        self.verify = verify
        self._root = root
        self._verified = verified
        # reading locations from the columns skips the storage entries, which verify needs
        self._columns: Optional[Callable[[MetadataIndex], ChunkLocation]] = None if verify else chunk_locator(metadata)
        self._chunks: dict[tuple[str, Any], StoredChunk] = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._layouts: dict[tuple[torch.dtype, tuple[int, ...]], Any] = {}  # header_layout of each
        # a model repeats a few (chunk shape, slice) pairs thousands of times: checked once each
        self._spans: dict[tuple[Any, Any, Any], _Geometry] = {}

    def locate(self, item: ReadItem, open_file: Callable[[str], Any]) -> tuple[StoredChunk, Any, _Geometry]:
        """``(stored chunk, its open file, slice geometry)`` of ``item``; raises
        :class:`CorruptCheckpointError` or :class:`CheckpointFormatError` naming file, FQN
        and chunk on any disagreement, or a slice outside its chunk."""
        index = item.storage_index
        chunk = self._chunks.get((index.fqn, index.offset))
        if chunk is None:
            chunk, opened = self._first_read(index, open_file)
        else:
            opened = open_file(chunk[0])
        geometry = self._spans.get((chunk[2], item.storage_offsets, item.lengths))
        return chunk, opened, self._span(item, chunk) if geometry is None else geometry

    def _span(self, item: ReadItem, chunk: StoredChunk) -> _Geometry:
        sizes, offsets, lengths = chunk[2], item.storage_offsets, item.lengths
        check_region(f"{self._root}/{chunk[0]}: {item.storage_index.fqn!r} chunk at offsets "
                     f"{list(item.storage_index.offset or ())}", offsets, lengths, sizes)
        first, span, contiguous = slice_span(sizes, offsets, lengths)
        geometry = self._spans[(sizes, offsets, lengths)] = (first, span, contiguous, math.prod(lengths))
        return geometry

    def _first_read(self, index: MetadataIndex, open_file: Callable[[str], Any]) -> tuple[StoredChunk, Any]:
        where = None if self._columns is None else self._columns(index)
        opened = None if where is None else open_file(where[0])
        md = self.metadata.state_dict_metadata[index.fqn]
        dtype = md.properties.dtype  # type: ignore[union-attr]
        if opened is not None and opened.trusted:  # the location as the metadata's columns give it
            name, data_offset, sizes = where  # type: ignore[misc]
        else:  # through the storage entry, compared with the file's header
            info = storage_entry(self.metadata, index, self._root)
            opened = open_file(info.relative_path)
            if info.key is None:
                raise CheckpointFormatError(f"{index.fqn!r}: tensor chunk stored without a key")
            name, data_offset = info.relative_path, info.offset
            sizes = where[2] if where is not None else chunk_sizes(self.metadata, index)
            layout = self._layouts.get((dtype, sizes))
            if layout is None:
                layout = self._layouts[(dtype, sizes)] = header_layout(dtype, sizes)
            entry = opened.header().get(info.key)
            if layout is None or entry != (layout[0], layout[1], info.offset, info.offset + info.length):
                why = entry_mismatch(entry, info.key, dtype, sizes, info.offset, info.length)
                if why is not None:
                    raise CorruptCheckpointError(f"{opened.name}: {index.fqn!r} chunk at offsets "
                                                 f"{list(index.offset or ())}: {why}")
            if self.verify and index not in self._verified:
                self._verify(index, info, opened)
        strides = self._strides.get(sizes)
        if strides is None:
            strides = self._strides[sizes] = tuple(row_major_strides(sizes))
        found = self._chunks[(index.fqn, index.offset)] = (name, data_offset, sizes, strides, dtype)
        return found, opened

    def _verify(self, index: MetadataIndex, info: StorageInfo, opened: Any) -> None:
        if info.checksum is None:
            raise CorruptCheckpointError(
                f"{opened.name}: {index.fqn!r} chunk at offsets {list(index.offset or ())} has no recorded "
                "checksum; load with verify=False to read it unverified")
        digest = opened.hash_range(info.offset, info.length)
        if digest != info.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {opened.name}: {index.fqn!r} chunk at offsets "
                f"{list(index.offset or ())} (key {info.key!r}) has xxh3 {digest}, metadata records "
                f"{info.checksum}")
        self._verified.add(index)


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory in batches (``execute_read`` into the planner's regions) of
    ``batch_items`` reads or ``batch_bytes``; up to ``HP_DCP_FILES_KEPT`` files stay open.
    ``bytes_read``: the file bytes spanned; ``verify``: check each chunk's xxh3.  A subclass
    overriding ``read_into`` or ``read_object`` reads item by item; one overriding the
    transport (:meth:`checkpoint_files`, :meth:`open_file`, :meth:`read_range`,
    :meth:`land_reads`) reads another storage through the same path."""

    item_by_item = False  # set for a subclass that overrides read_into / read_object
    batch_items: Optional[int] = None  # None: BATCH_ITEMS, BATCH_BYTES
    batch_bytes: Optional[int] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "read_into" in cls.__dict__ or "read_object" in cls.__dict__:
            cls.item_by_item = True

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = False) -> None:
        self.path: Optional[Path] = Path(path) if path is not None else None
        self.verify = verify
        self.rank = 0
        self.metadata: Optional[Metadata] = None
        self._is_global = True
        self._handles: OrderedDict[str, _OpenFile] = OrderedDict()
        self._latest: Optional[_OpenFile] = None  # the most recently used of them
        self._locator: Optional[ChunkLocator] = None
        self._verified: set[MetadataIndex] = set()
        self._reads = AdjacentReads()
        self.compressed = CompressedFiles()  # the .zstd files (no reference to the reader: no cycle)
        self._device_reads = DeviceReads()
        self._copies = PendingCopies()  # views of the files' mappings: copied before a file closes
        self._arena: Optional[MappingArena] = None  # where the open files are mapped
        self._arena_tried = False
        self.bytes_read = 0
        self.files_kept = FILES_KEPT.get()

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.metadata = None
        self._close_all()
        self._verified = set()
        self._locator = None
        self.bytes_read = 0

    def _root(self) -> Path:
        if self.path is None:
            raise ValueError("FileSystemReader has no checkpoint path: pass checkpoint_id or a path")
        return self.path

    def location(self) -> Optional[str]:
        return None if self.path is None else str(self.path)

    def checkpoint_files(self) -> CheckpointFiles:
        """The checkpoint's location (metadata, naming its files in messages)."""
        return LocalFiles(self._root())

    def load_metadata(self) -> Metadata:
        self.metadata, self._is_global = load_checkpoint_metadata(self.checkpoint_files())
        return self.metadata

    def read_metadata_payload(self) -> StoredMetadata:
        """The stored bytes (read once per job, broadcast by the load, parsed on every rank)."""
        stored = read_stored_metadata(self.checkpoint_files())
        self._is_global = stored.is_global
        return stored

    def metadata_from_payload(self, payload: StoredMetadata) -> Metadata:
        """Parse the coordinator's bytes (:class:`CheckpointNotFoundError` unless this rank sees the checkpoint)."""
        root = self._root()
        if not root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
        if payload.is_global and not (root / METADATA_FILE).is_file():
            raise CheckpointNotFoundError(f"{root / METADATA_FILE} does not exist on this rank, but the coordinator "
                                          f"read {payload.source}: every rank must see the same checkpoint")
        self.metadata = payload.parse(LocalFiles(root))
        self._is_global = payload.is_global
        return self.metadata

    @property
    def collectives_required(self) -> bool:
        return self._is_global

    def reads_are_copies(self) -> bool:
        """Whether every file is wholly in the page cache (``False`` where the kernel cannot tell)."""
        files = self.metadata.files if self.metadata is not None else {}
        root = self._root()
        for name, size in files.items():
            try:
                fd = os.open(root / name, os.O_RDONLY)
            except OSError:
                return False
            try:
                if not cached(fd, 0, size):
                    return False
            finally:
                os.close(fd)
        return bool(files)

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        self.metadata = metadata
        self.rank = rank

    def chunks(self) -> ChunkLocator:
        """The :class:`ChunkLocator` of the current metadata (made on first use)."""
        locator = self._locator
        if locator is None or locator.metadata is not self.metadata or locator.verify is not self.verify:
            assert self.metadata is not None
            locator = self._locator = ChunkLocator(self.metadata, str(self.checkpoint_files()), self.verify,
                                                   self._verified)
        return locator

    def open_file(self, name: str) -> Any:
        """The checkpoint's file ``name`` opened for :meth:`chunks` and the reads (its size and
        header checked against ``.metadata``); :class:`CheckpointNotFoundError` when missing."""
        metadata = self.metadata
        return _OpenFile(self._root() / name, metadata.files.get(name) if metadata else None,
                         metadata.header_digests.get(name) if metadata else None, name)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """The bytes ``[offset, offset + length)`` of file ``name`` (fewer where it ends first);
        :class:`CheckpointNotFoundError` when it is missing."""
        file = self._root() / name
        try:
            with open(file, "rb") as f:
                return os.pread(f.fileno(), length, offset)
        except FileNotFoundError:
            raise missing_file_error(str(file), name) from None

    def land_reads(self, drop: bool = False) -> None:
        """Return once the reads the opened files started have landed (``drop``: cancel those
        not begun, ignore errors); a file's ``preadv`` has landed when it returns."""

    def _file(self, name: str) -> Any:
        """The open file ``name``, opened (and the least recently used one closed) if needed."""
        opened = self._handles.get(name)
        if opened is not None:
            # recency is kept only once the next open evicts: one lookup per read
            if opened is not self._latest and len(self._handles) >= self.files_kept:
                self._handles.move_to_end(name)
                self._latest = opened
            return opened
        opened = self.open_file(name)
        self._handles[name] = opened
        self._latest = opened
        if len(self._handles) > self.files_kept:
            self._finish_pending()  # pending copies and reads may use the file closed next
            self._handles.popitem(last=False)[1].close()
        return opened

    def _arena_for_files(self) -> Optional[MappingArena]:
        """The arena the open files are mapped in; ``None`` for one file or a refused reservation."""
        if not self._arena_tried:
            self._arena_tried = True
            sizes = self.metadata.files.values() if self.metadata is not None else ()
            if len(sizes) > 1:
                slot = max(sizes)
                slots = min(len(sizes), self.files_kept, ARENA_MAX_BYTES // max(slot, 1))
                if slots > 1:
                    self._arena = MappingArena.reserve(slot, slots)
        return self._arena

    def _close_all(self) -> None:
        self._finish_pending()
        self.compressed.close()
        self._latest = None
        while self._handles:
            self._handles.popitem()[1].close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._arena_tried = False

    def _read_many(self, reads: Iterable[tuple[ReadItem, _Region]]) -> None:
        """Start each read (done, or queued in a sink for :meth:`_finish_pending`)."""
        locator, open_file = self.chunks(), self._file
        adjacent, device_reads, copies = self._reads, self._device_reads, self._copies
        metadata, verified = self.metadata, self._verified if self.verify else None
        if compressed := self.compressed.any_in(metadata):  # chunks of .zstd files: read ahead of their decoding
            reads = list(reads)
            self.compressed.read_ahead(self._root(), metadata, [it for it, _ in reads], verified)  # type: ignore
        spanned = 0
        try:
            for item, (dest, offset, dest_strides) in reads:
                read = None if not compressed else self.compressed.read_item(  # a chunk of a .zstd file
                    self._root(), metadata, item, dest, offset, dest_strides, verified)  # type: ignore[arg-type]
                if read is not None:
                    spanned += read
                    continue
                (_, data_offset, sizes, strides, dtype), opened, (first, span, contiguous, count) = \
                    locator.locate(item, open_file)
                lengths, itemsize = item.lengths, dtype.itemsize
                if contiguous:
                    if offset is not None:
                        dest, offset = dest.as_strided(lengths, dest_strides, offset), None
                    start = data_offset + first * itemsize
                    if adjacent.add(opened, start, dest, dtype) or (not dest.is_cpu and opened.fd is not None
                                                                   and device_reads.add(opened.fd, opened.name, start,
                                                                                        dest, dtype)):
                        spanned += span * itemsize
                        continue
                # a column slice, or a strided destination: copied from the file's mapping
                if span and dest.is_cpu:
                    mapping = opened.mapped if opened.mapped is not None else opened.mapping(self._arena_for_files)
                    found = None if mapping is None else mapping.slice_at(data_offset, dtype, first, span)
                    if found is not None:
                        copies.add_mapped(dest, found[0], found[1], lengths, strides, count * itemsize,
                                          None if offset is None else (offset, dest_strides))
                        spanned += span * itemsize
                        continue
                if offset is not None:
                    dest = dest.as_strided(lengths, dest_strides, offset)
                spanned += read_slice_into(opened, data_offset, sizes, dtype, item.storage_offsets, lengths, dest,
                                           strides, copies)
                if copies.nbytes >= (self.batch_bytes or BATCH_BYTES):  # staging buffers waiting for reads that land later
                    self._finish_pending()
        finally:
            self.bytes_read += spanned

    def _finish_pending(self) -> None:
        """Complete every queued read and copy (before a file closes, before handing on)."""
        self._reads.flush()
        self.land_reads()
        self._copies.flush()
        self._device_reads.flush()
        self._device_reads.wait()

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` with the stored slice; ``CorruptCheckpointError`` naming file, FQN and chunk on a mismatch."""
        try:
            self._read_many(((item, (dest, None, ())),))
        finally:
            self._finish_pending()

    def read_stream(self, reads: Iterable[ReadDestination]) -> Iterator[tuple[ReadItem, Any]]:
        """``read_into`` / ``read_object`` of each read, yielded in order a batch at a time."""
        if self.item_by_item:
            yield from super().read_stream(reads)
            return
        yield from self._batched((item, (dest, None, ())) for item, dest in reads)

    def _batched(self, reads: Iterable[tuple[ReadItem, _Region]]) -> Iterator[tuple[ReadItem, Any]]:
        """``read_stream`` of ``(item, _Region)``: yields each read but those into a region."""
        batch: list[tuple[ReadItem, Any]] = []
        pending: list[tuple[ReadItem, _Region]] = []
        count = nbytes = 0
        most_items, most_bytes = self.batch_items or BATCH_ITEMS, self.batch_bytes or BATCH_BYTES
        try:
            for read in reads:
                item, (dest, offset, _) = read
                if dest is None:
                    batch.append((item, self.read_object(item)))
                else:
                    pending.append(read)
                    if offset is None:  # a region is filled in place: nothing to yield
                        batch.append((item, dest))
                        nbytes += dest.nbytes
                count += 1
                if count >= most_items or nbytes >= most_bytes:
                    self._read_many(pending)
                    self._finish_pending()
                    yield from batch
                    batch, pending = [], []
                    count = nbytes = 0
            self._read_many(pending)
            self._finish_pending()
            yield from batch
        finally:
            self._reads.clear()  # a stream left early drops its queued work
            self.land_reads(drop=True)
            self.compressed.cancel()
            self._copies.clear()
            self._device_reads.clear()

    def read_object(self, item: ReadItem) -> Any:
        """The stored object; from a per-rank checkpoint, the copy this rank saved (SPEC §4)."""
        blob, file = self.read_object_bytes(item)
        return deserialize_object(blob, fqn=item.storage_index.fqn, file=file)

    def read_object_bytes(self, item: ReadItem) -> tuple[bytes, str]:
        """``(stored bytes, file)`` of the object, checked (length, checksum with ``verify``)."""
        assert self.metadata is not None
        files = self.checkpoint_files()
        info = storage_entry(self.metadata, item.storage_index, files)
        if self.metadata.rank_objects:
            info = self.metadata.object_storage(item.storage_index.fqn, self.rank) or info
        file = files.where(info.relative_path)
        blob = self.read_range(info.relative_path, info.offset, info.length)
        if len(blob) != info.length:
            raise CorruptCheckpointError(f"{item.storage_index.fqn!r}: {file} is truncated ({len(blob)} of "
                                         f"{info.length} bytes at offset {info.offset})")
        self.bytes_read += len(blob)
        if self.verify and info.checksum is not None and xxhash.xxh3_64_hexdigest(blob) != info.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {file}: object {item.storage_index.fqn!r} does not match its recorded xxh3")
        return blob, file

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read this rank's items in file order, into the planner's regions where it has them."""
        items = self.sort_items([it for it in plan.items if it.source is None or it.source == self.rank])
        if self.compressed.any_in(self.metadata):  # every payload read ahead, not a batch's: no idle link between
            self.compressed.read_ahead(self._root(), self.metadata, items,  # type: ignore[arg-type]
                                       self._verified if self.verify else None, whole=True)
        try:
            self._execute_read(items, planner)
        finally:
            self.compressed.cancel()

    def _execute_read(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        region = getattr(planner, "resolve_region", None)
        if region is None or self.item_by_item:
            read_items(self, planner, items)
            return
        byte_io = LoadItemType.BYTE_IO
        tensors = [item for item in items if item.type is not byte_io]
        if len(tensors) < len(items):
            for item in items:
                if item.type is byte_io:
                    planner.load_bytes(item, self.read_object(item))
        commit_tensor = planner.commit_tensor
        for item, value in self._batched(zip(tensors, map(region, tensors))):
            commit_tensor(item, value)
