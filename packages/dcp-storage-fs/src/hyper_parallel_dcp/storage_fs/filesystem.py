"""``FileSystemWriter`` / ``FileSystemReader``: one safetensors file per writing rank.

Layout of ``<checkpoint_id>/``: ``_rank{r}_.safetensors`` (tensor chunks in global
``(fqn, offset)`` order, readable by ``safetensors`` as is), ``_rank{r}_.bytes`` (pickled
non-tensor objects), and ``.metadata`` (JSON, written last) — or ``{rank}.metadata`` per
rank for a save without collectives.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from operator import add, gt
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides
from hyper_parallel_dcp.core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from hyper_parallel_dcp.core.metadata import (
    ChunkLocation,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    chunk_columns,
    chunk_locator,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel_dcp.core.objects import deserialize_object
from hyper_parallel_dcp.core.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from hyper_parallel_dcp.core.settings import FILES_KEPT
from hyper_parallel_dcp.core.storage import ReadDestination, StorageReader, StorageWriter, WriteResult, read_items

from . import direct_read
from .atomic import PendingFile, fsync_dir, write_file_atomic, write_file_pending
from .commit import SaveLock, commit_directory, remove_stale_staging, staging_dir
from .direct_read import (
    AdjacentReads,
    DeviceReads,
    FileMapping,
    MappingArena,
    PendingCopies,
    read_slice,
    span_from_strides,
)
from .rank_files import objects_file_name, tensors_file_name, with_stored_as, write_rank_files
from .rank_metadata import RANK_METADATA, load_rank_metadata, merge_rank_metadata
from .safetensors_stream import (
    SAFETENSORS_DTYPES,
    HeaderEntry,
    SafetensorsHeaderError,
    entry_mismatch,
    header_digest,
    parse_header,
    read_header_bytes,
    stored_layout,
)

__all__ = [
    "METADATA_FILE",
    "FileSystemReader",
    "FileSystemWriter",
    "StoredMetadata",
    "load_checkpoint_metadata",
    "merge_rank_metadata",
    "read_stored_metadata",
]

METADATA_FILE = ".metadata"


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint directory on a (local or shared) filesystem.

    A save with a global view (collectives on, or a single process) is atomic: data goes
    to a staging directory beside the target and is swapped in when ``.metadata`` is
    written; an older checkpoint at the target stays loadable until then.  A multi-rank
    save with ``use_collectives=False`` writes in place (``{rank}.metadata`` each).
    ``sync_files`` fsyncs every file (turn off only for throwaway checkpoints).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, sync_files: bool = True) -> None:
        self.path: Optional[Path] = Path(path) if path is not None else None
        self.sync_files = sync_files
        self.rank = 0
        self.world_size = 1
        self.is_coordinator = True
        self.atomic = True
        self._lock: Optional[SaveLock] = None
        self._save_id: Optional[str] = None
        self._syncing: Optional[_BackgroundSync] = None
        # (metadata, its JSON, the .metadata written but not committed) from prepare_finalize
        self._prepared: Optional[tuple[Metadata, bytes, Optional[PendingFile]]] = None

    # -- set-up ----------------------------------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self._save_id = None

    def _target(self) -> Path:
        if self.path is None:
            raise ValueError("FileSystemWriter has no checkpoint path: pass checkpoint_id or a path")
        return self.path

    def set_up_storage_writer(self, *, is_coordinator: bool, rank: int = 0, world_size: int = 1,
                              use_collectives: bool = True) -> None:
        target = self._target()
        self.rank = rank
        self.world_size = world_size
        self.is_coordinator = is_coordinator
        self.atomic = use_collectives or world_size == 1
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"checkpoint path {target} exists and is not a directory")
        self._release_lock()

    def _ensure_lock(self) -> None:
        """Take the save lock (coordinator of an atomic save), once per save.

        Called inside the pipeline's failure-propagating steps, so a refused concurrent
        save is raised on every rank rather than leaving the others waiting.
        """
        if not (self.atomic and self.is_coordinator) or self._lock is not None:
            return
        lock = SaveLock(self._target())
        lock.acquire()
        self._lock = lock
        remove_stale_staging(self._target(), keep=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._ensure_lock()
        return plan

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _data_dir(self) -> Path:
        target = self._target()
        if not self.atomic:
            return target
        if self._save_id is None:
            raise RuntimeError("FileSystemWriter: the plan carries no save_id")
        return staging_dir(target, self._save_id)

    # -- writing ---------------------------------------------------------------------
    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        self._save_id = plan.save_id or "local"
        self._ensure_lock()  # a cached plan skips prepare_local_plan
        out_dir = self._data_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        if not self.atomic:
            stale_files = [out_dir / METADATA_FILE, out_dir / f"{self.rank}.metadata"]
            if self.rank == 0:
                # Per-rank metadata of ranks this save does not have (an earlier save on
                # more ranks) would be merged into this checkpoint by a loader.
                for entry in os.scandir(out_dir):
                    match = RANK_METADATA.match(entry.name)
                    if match and int(match.group(1)) >= self.world_size:
                        stale_files.append(Path(entry.path))
            for stale in stale_files:
                try:
                    stale.unlink()  # the directory no longer holds that checkpoint
                except FileNotFoundError:
                    pass
        # The files this save replaces are dropped from the page cache first (see
        # _drop_replaced); their data stays on disk until the commit.
        _drop_replaced([self._target() / tensors_file_name(self.rank), self._target() / objects_file_name(self.rank)])
        pending: list[PendingFile] = []

        def write_file(name: str, data_writer: Any) -> int:
            written = write_file_pending(out_dir / name, data_writer)
            pending.append(written)
            return written.size

        started: list[_BackgroundSync] = []

        def start_sync() -> None:
            # The fsyncs run while the chunks are hashed, the results travel to the
            # coordinator and it builds the metadata; sync_written() waits for them before
            # this rank confirms.
            started.append(_BackgroundSync(pending))
            self._syncing = started[0]

        try:
            results = write_rank_files(plan, planner, self.rank, write_file,
                                       files_written=start_sync if self.sync_files else None)
        except BaseException:
            if not started:  # else the files are the sync thread's: abort() waits for it
                for written in pending:
                    written.discard()
            raise
        if not self.sync_files:
            for written in pending:
                written.finish(sync=False)
        return results

    def sync_written(self) -> None:
        """Wait until the files of ``execute_write`` are fsynced and in place; raises the
        first ``OSError`` of that, naming the file."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.wait()

    def prepare_finalize(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Serialise the metadata; in a staging directory (invisible until the commit) also
        write it there, not yet fsynced nor renamed."""
        self._discard_prepared()
        text = metadata_to_json(with_stored_as(metadata)).encode()
        written = None
        if self.atomic:
            out_dir = self._data_dir()
            out_dir.mkdir(parents=True, exist_ok=True)
            written = write_file_pending(out_dir / METADATA_FILE, lambda f: f.write(text))
        self._prepared = (metadata, text, written)

    def _discard_prepared(self) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[2] is not None:
            prepared[2].discard()

    def finalize_checkpoint(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.sync_written()  # this rank's own files before the commit (the pipeline waited already)
        out_dir = self._data_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        name = METADATA_FILE if self.atomic else f"{self.rank}.metadata"
        if self._prepared is not None and self._prepared[0] is not metadata:
            self._discard_prepared()  # prepared for other metadata: serialise this one
        prepared, self._prepared = self._prepared, None
        try:
            if prepared is not None and prepared[2] is not None:
                prepared[2].finish(self.sync_files)  # written by prepare_finalize: fsync, rename
            else:
                text = prepared[1] if prepared is not None else metadata_to_json(with_stored_as(metadata)).encode()
                write_file_atomic(out_dir / name, lambda f: f.write(text), self.sync_files)
            if self.atomic:
                commit_directory(out_dir, self._target())
            elif self.sync_files:
                fsync_dir(out_dir)
        finally:
            self._release_lock()

    def abort(self, error: BaseException) -> None:
        try:
            try:
                self.sync_written()  # nothing may still be renaming into the directory removed below
            except OSError:
                pass
            self._discard_prepared()
            if self.atomic and self.is_coordinator and self._save_id is not None:
                import shutil

                shutil.rmtree(self._data_dir(), ignore_errors=True)
        finally:
            self._release_lock()

    def __del__(self) -> None:  # a writer dropped mid-save must not keep the lock
        try:
            self._release_lock()
        except Exception:  # noqa: BLE001
            pass


def _drop_replaced(paths: Iterable[Path]) -> None:
    """Drop the page cache of ``paths``, the rank's files of the checkpoint this save replaces.

    Their pages are clean (fsynced by the save that wrote them) and are freed anyway when
    the replaced checkpoint is deleted after the commit.  Freed now, they are the memory
    this save writes into.  Otherwise the writes take pages the kernel must find elsewhere
    (reclaim, or on this project's VM pages the host has to fault back in): writing 2 x 505
    MiB next to the copy they replace took 1.3-4.1 s, against 0.3-0.8 s with that copy
    dropped first or removed before (drop included; alternating runs, load 3-5).  Only
    the cache is dropped (``POSIX_FADV_DONTNEED``): the old files stay whole and loadable
    until the swap, so a crash at any moment still leaves the old or the new checkpoint.
    A missing file, or a platform without ``posix_fadvise``, is skipped.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class _BackgroundSync:
    """fsync and rename written files on a thread (``os.fsync`` releases the GIL)."""

    def __init__(self, files: list[PendingFile]) -> None:
        self._files = files
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="hp-dcp-fsync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for position, written in enumerate(self._files):
            try:
                written.finish(sync=True)
            except BaseException as exc:  # noqa: BLE001 - raised by wait() on the saving thread
                self._error = exc
                for rest in self._files[position + 1:]:
                    rest.discard()
                return

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


# ------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class StoredMetadata:
    """A checkpoint's ``.metadata`` as stored: what one rank reads and broadcasts to the rest.

    ``data`` is the JSON of ``.metadata``; ``source`` names the file(s) in errors.  For a
    checkpoint saved without collectives ``merged`` is the merge of its ``{rank}.metadata``
    files instead (it carries every rank's copy of a rank-local object, which one JSON
    document does not) and ``is_global`` is false.
    """

    data: bytes
    source: str
    is_global: bool
    merged: Optional[Metadata] = None

    def parse(self, root: Optional[Path] = None) -> Metadata:
        """The metadata; ``root``: the checkpoint directory as this rank sees it, where an
        altered ``.metadata`` is compared with the data files to name what changed."""
        if self.merged is not None:
            return self.merged
        return _parse_metadata(self.data, self.source, root if root is not None else Path(self.source).parent)


def _parse_metadata(data: bytes, source: str, root: Path) -> Metadata:
    """``metadata_from_json``; a ``.metadata`` changed after the save is refused with the
    first chunk whose location no longer agrees with its file's header, where one does."""
    try:
        return metadata_from_json(data, source=source)
    except CorruptCheckpointError as exc:
        from .integrity import header_disagreement  # integrity imports this module

        found = header_disagreement(root, metadata_from_json(data, source=source, check_digest=False))
        if found is None:
            found = "none in the chunk locations (the change is elsewhere in the file)"
        raise CorruptCheckpointError(f"{exc}; first disagreement with the data files: {found}") from None


def read_stored_metadata(path: Union[str, os.PathLike]) -> StoredMetadata:
    """The bytes of ``.metadata`` or, failing that, every ``{rank}.metadata`` merged.

    Raises as :func:`load_checkpoint_metadata` does (the merge parses the per-rank files).
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    global_file = root / METADATA_FILE
    try:
        return StoredMetadata(global_file.read_bytes(), str(global_file), True)
    except FileNotFoundError:
        pass
    merged = merge_rank_metadata(load_rank_metadata(root))
    return StoredMetadata(b"", f"{root}/{{rank}}.metadata (merged)", False, merged)


def load_checkpoint_metadata(path: Union[str, os.PathLike]) -> tuple[Metadata, bool]:
    """Read ``.metadata`` or, failing that, merge every ``{rank}.metadata``
    (:func:`merge_rank_metadata`: each rank's own copy of a rank-local object is kept).

    Returns ``(metadata, is_global)``.  Raises :class:`CheckpointNotFoundError` naming the
    directory when it or any metadata is missing, :class:`CheckpointFormatError` when the
    metadata is unreadable or of a newer format version.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    global_file = root / METADATA_FILE
    try:
        text = global_file.read_bytes()
    except FileNotFoundError:
        text = None
    if text is not None:
        return _parse_metadata(text, str(global_file), root), True
    return merge_rank_metadata(load_rank_metadata(root)), False


class _OpenFile:
    """An open shard file: its header, an mmap for hashing and a mapping for column slices
    (each made on first use).

    ``trusted``: the header bytes are the ones the save recorded a digest of in
    ``.metadata``, so every chunk's location comes from the metadata alone;
    ``parse_header`` parses them on first use (only an untrusted file's chunks need it).
    """

    def __init__(self, path: Path, fobj: Any, size: int, raw_header: bytes, trusted: bool):
        self.path = path
        self.name = str(path)
        self.fobj = fobj
        self.fd = fobj.fileno()
        self.size = size
        self.trusted = trusted
        self._raw_header: Optional[bytes] = raw_header
        self._header: Optional[dict[str, HeaderEntry]] = None
        self._map: Optional[mmap.mmap] = None
        # the file's FileMapping once mapping() has made it (None before, or where it
        # cannot be mapped): read directly by the reader's per-read path
        self.mapped: Optional[FileMapping] = None
        self.mapping_tried = False

    def parse_header(self) -> dict[str, HeaderEntry]:
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

    def mapping(self, arena: Optional[MappingArena] = None) -> Optional[FileMapping]:
        """The file mapped for strided copies, in a slot of ``arena`` if it has one free
        (``None`` where it cannot be mapped)."""
        if not self.mapping_tried:
            self.mapping_tried = True
            self.mapped = FileMapping.open(self.fd, self.size, arena)
        return self.mapped

    def hash_range(self, offset: int, length: int) -> str:
        """xxh3-64 of the file's bytes ``[offset, offset + length)``, hashed in place (mmap)."""
        if length == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        if self._map is None:
            self._map = mmap.mmap(self.fobj.fileno(), 0, access=mmap.ACCESS_READ)
        with memoryview(self._map) as view:
            with view[offset:offset + length] as part:
                return xxhash.xxh3_64_hexdigest(part)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        self.fobj.close()


#: a read stream completes and yields its reads in batches of this many or this size
_BATCH_ITEMS = 256
_BATCH_BYTES = 32 << 20
#: the most address space a reader reserves for its files' mappings (see MappingArena)
_ARENA_MAX_BYTES = 1 << 42


# A stored chunk's checked location: (file, first data byte, shape, row-major strides,
# dtype).  A plain tuple: one is made per chunk a load reads.
_StoredChunk = tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype]
# where a read goes: (destination, None, ()), or (tensor, storage offset, strides) of a
# region (LoadPlanner.resolve_region); destination None for an object
_Region = tuple[Any, Optional[int], tuple[int, ...]]


def _header_layout(dtype: torch.dtype, sizes: tuple[int, ...]) -> Optional[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(safetensors dtype, shape, row-major strides)`` of a chunk as its header records
    it; ``None`` where it cannot be stored (``entry_mismatch`` then says why)."""
    try:
        stored_dtype, shape = stored_layout(dtype, sizes)
    except TypeError:
        return None
    name = SAFETENSORS_DTYPES.get(stored_dtype)
    return None if name is None else (name, shape, tuple(row_major_strides(sizes)))


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory: each item's slice straight into its destination.

    Every tensor read is ``read_into`` (``preadv`` of the slice's byte span into the
    destination, see ``direct_read``), every object read ``read_object``, in the global
    ``(fqn, offset)`` order: a broadcast load through ``core.storage.read_items``, a
    plain load (``execute_read``) through the same batches with the planner's regions
    (``LoadPlanner.resolve_region``: no view per read, the column slices one tensor
    takes from several files copied as one from a ``MappingArena``).  Up to
    ``HP_DCP_FILES_KEPT`` files (default 8) stay open.  ``bytes_read`` counts the file
    bytes the reads span (a column slice spans every row it touches).
    ``verify`` checks the xxh3 checksum of every stored chunk a read touches (the whole
    chunk is hashed once per reader).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = False) -> None:
        self.path: Optional[Path] = Path(path) if path is not None else None
        self.verify = verify
        self.rank = 0
        self.metadata: Optional[Metadata] = None
        self._is_global = True
        self._handles: OrderedDict[str, _OpenFile] = OrderedDict()
        self._latest: Optional[_OpenFile] = None  # the most recently used of them
        self._verified: set[MetadataIndex] = set()
        # (fqn, chunk offsets) -> _StoredChunk, for every chunk read since the last reset
        self._chunks: dict[tuple[str, Any], _StoredChunk] = {}
        # (metadata, verify, core.metadata.chunk_locator of it or None with verify: every
        # chunk is then checked through its storage entry), made on the first lookup
        self._locator: tuple[Optional[Metadata], bool, Optional[Callable[[MetadataIndex], ChunkLocation]]] = (
            None, False, None)
        self._layouts: dict[tuple[torch.dtype, tuple[int, ...]], Any] = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        # (chunk shape, slice offsets, slice lengths) -> span_from_strides of that slice
        # and its element count
        self._spans: dict[tuple[tuple[int, ...], Any, Any], tuple[int, int, bool, int]] = {}
        # column slices waiting for one batched copy (views of a file's mapping: copied
        # before that file can be closed), and contiguous reads of adjacent file ranges
        # waiting for one preadv
        self._copies = PendingCopies()
        self._reads = AdjacentReads()
        self._device_reads = DeviceReads()  # contiguous reads into accelerator tensors
        # where the open files are mapped (reserved on the first mapping; see _reserve_arena)
        self._arena: Optional[MappingArena] = None
        self._arena_tried = False
        self.bytes_read = 0
        self.files_kept = FILES_KEPT.get()

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.metadata = None
        self._close_all()
        self._verified = set()
        self._chunks = {}
        self.bytes_read = 0

    def _root(self) -> Path:
        if self.path is None:
            raise ValueError("FileSystemReader has no checkpoint path: pass checkpoint_id or a path")
        return self.path

    def location(self) -> Optional[str]:
        return None if self.path is None else str(self.path)

    def load_metadata(self) -> Metadata:
        self.metadata, self._is_global = load_checkpoint_metadata(self._root())
        return self.metadata

    def read_metadata_payload(self) -> StoredMetadata:
        """The stored bytes (read once per job, broadcast by the load, parsed on every rank)."""
        stored = read_stored_metadata(self._root())
        self._is_global = stored.is_global
        return stored

    def metadata_from_payload(self, payload: StoredMetadata) -> Metadata:
        """Parse the coordinator's bytes, after a ``stat`` that this rank sees the same
        checkpoint (a rank given another path, or without the shared filesystem, fails
        here, naming its path, instead of reading nothing or the wrong files later)."""
        root = self._root()
        if not root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
        if payload.is_global and not (root / METADATA_FILE).is_file():
            raise CheckpointNotFoundError(
                f"{root / METADATA_FILE} does not exist on this rank, but the coordinator read "
                f"{payload.source}: every rank must see the same checkpoint"
            )
        self.metadata = payload.parse(root)
        self._is_global = payload.is_global
        return self.metadata

    @property
    def collectives_required(self) -> bool:
        return self._is_global

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        if metadata is not self.metadata:
            self._chunks = {}
        self.metadata = metadata
        self.rank = rank

    # -- file access -----------------------------------------------------------------
    def _close_all(self) -> None:
        self._finish_pending()
        self._latest = None
        while self._handles:
            self._handles.popitem()[1].close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._arena_tried = False

    def _reserve_arena(self) -> Optional[MappingArena]:
        """The arena the open files are mapped in: one slot per file that can be open at
        once (``files_kept``), each the size of the checkpoint's largest file; ``None``
        for a checkpoint of one file, one whose file sizes the metadata does not record,
        or where the address space cannot be reserved (each file is then mapped alone)."""
        if not self._arena_tried:
            self._arena_tried = True
            sizes = self.metadata.files.values() if self.metadata is not None else ()
            if len(sizes) > 1:
                slot = max(sizes)
                slots = min(len(sizes), self.files_kept, _ARENA_MAX_BYTES // max(slot, 1))
                if slots > 1:
                    self._arena = MappingArena.reserve(slot, slots)
        return self._arena

    def _open(self, name: str) -> _OpenFile:
        opened = self._handles.get(name)
        if opened is not None:
            # recency matters only once the next open evicts (a resharded load
            # alternates between files: one lookup per read, no reordering)
            if opened is not self._latest and len(self._handles) >= self.files_kept:
                self._handles.move_to_end(name)
                self._latest = opened
            return opened
        file = self._root() / name
        expected = (self.metadata.files if self.metadata else {}).get(name)
        digest = self.metadata.header_digests.get(name) if self.metadata else None
        try:
            fobj = open(file, "rb")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint file {file} is missing") from None
        try:
            actual = os.fstat(fobj.fileno()).st_size
            if expected is not None and actual != expected:
                raise CorruptCheckpointError(
                    f"checkpoint file {file} has {actual} bytes but the metadata records {expected} "
                    "(truncated or replaced)"
                )
            try:
                raw_header = read_header_bytes(fobj, actual)
            except SafetensorsHeaderError as exc:
                raise CorruptCheckpointError(f"checkpoint file {file} is not a valid safetensors file: {exc}") from None
            # The bytes the save wrote with exactly these storage entries, in a file of the
            # size it wrote (the digest covers both): no JSON parse and no per-chunk comparison (2000 chunks: 4.5 ms parse + ~10 ms of checks per
            # file).  Another header (corrupted, another save's file, an imported
            # checkpoint, no digest recorded) takes the full check, which names the chunk.
            opened = _OpenFile(file, fobj, actual, raw_header,
                               digest is not None and header_digest(raw_header, actual) == digest)
            if not opened.trusted:
                opened.parse_header()  # a malformed header fails at open, as before
        except BaseException:
            fobj.close()
            raise
        self._handles[name] = opened
        self._latest = opened
        if len(self._handles) > self.files_kept:
            self._finish_pending()  # pending copies and reads may use the file closed next
            self._handles.popitem(last=False)[1].close()
        return opened

    def _storage_info(self, index: MetadataIndex) -> StorageInfo:
        assert self.metadata is not None and self.metadata.storage_data is not None
        try:
            return self.metadata.storage_data[index]
        except KeyError:
            raise CheckpointFormatError(
                f"{index.fqn!r}: the metadata of {self._root()} has no storage entry for the chunk at {index.offset}"
            ) from None

    def _chunk_sizes(self, index: MetadataIndex, md: Optional[TensorStorageMetadata] = None) -> tuple[int, ...]:
        # from the metadata's columns: a load builds no object per stored chunk
        if md is None:
            assert self.metadata is not None
            found = self.metadata.state_dict_metadata[index.fqn]
            assert isinstance(found, TensorStorageMetadata)
            md = found
        ndim, offsets, sizes, _ = chunk_columns(md)
        want = tuple(index.offset or ())
        if ndim == 0 or not want:
            if not want and md.chunks:
                return md.chunks[0].sizes
        else:
            hint = index.index
            if hint is None or not 0 <= hint < len(offsets) // ndim or tuple(
                    offsets[hint * ndim:(hint + 1) * ndim]) != want:
                hint = next((pos for pos in range(len(offsets) // ndim)
                             if tuple(offsets[pos * ndim:(pos + 1) * ndim]) == want), None)
            if hint is not None:
                return tuple(sizes[hint * ndim:(hint + 1) * ndim])
        raise CheckpointFormatError(f"{index.fqn!r}: no stored chunk at offsets {index.offset}")

    def _verify_chunk(self, index: MetadataIndex, info: StorageInfo, opened: _OpenFile) -> None:
        if index in self._verified:
            return
        if info.checksum is None:
            raise CorruptCheckpointError(
                f"{opened.path}: {index.fqn!r} chunk at offsets {list(index.offset or ())} has no recorded "
                "checksum; load with verify=False to read it unverified"
            )
        digest = opened.hash_range(info.offset, info.length)
        if digest != info.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {opened.path}: {index.fqn!r} chunk at offsets "
                f"{list(index.offset or ())} (key {info.key!r}) has xxh3 {digest}, metadata records {info.checksum}"
            )
        self._verified.add(index)

    def _chunk_locator(self) -> Optional[Callable[[MetadataIndex], ChunkLocation]]:
        """``core.metadata.chunk_locator`` of the metadata (made once per metadata), or
        ``None`` with ``verify`` (every chunk is then checked through its storage entry)."""
        metadata = self.metadata
        assert metadata is not None
        known, verify, locate = self._locator
        if known is not metadata or verify is not self.verify:
            locate = None if self.verify else chunk_locator(metadata)
            self._locator = (metadata, self.verify, locate)
        return locate

    def _checked_chunk(self, index: MetadataIndex) -> _StoredChunk:
        """The checked location of a stored chunk through its storage entry (``_read_many``
        where the metadata's columns do not serve): its header entry compared, its
        checksum verified (``verify``); the error names file, key and chunk.  Remembered
        in ``_chunks``."""
        key = (index.fqn, index.offset)
        info = self._storage_info(index)
        opened = self._open(info.relative_path)
        if info.key is None:
            raise CheckpointFormatError(f"{index.fqn!r}: tensor chunk stored without a key")
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata[index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        chunk_sizes = self._chunk_sizes(index, md)
        dtype = md.properties.dtype
        layout = self._layouts.get((dtype, chunk_sizes))
        if layout is None:
            layout = self._layouts[(dtype, chunk_sizes)] = _header_layout(dtype, chunk_sizes)
        entry = opened.parse_header().get(info.key)
        if layout is None or entry != (layout[0], layout[1], info.offset, info.offset + info.length):
            why = entry_mismatch(entry, info.key, dtype, chunk_sizes, info.offset, info.length)
            if why is not None:
                raise CorruptCheckpointError(f"{opened.path}: {index.fqn!r} chunk at offsets "
                                             f"{list(index.offset or ())}: {why}")
        if self.verify:
            self._verify_chunk(index, info, opened)
        found = self._chunks[key] = (info.relative_path, info.offset, chunk_sizes, layout[2] if layout else
                                     tuple(row_major_strides(chunk_sizes)), dtype)
        return found

    def _read(self, item: ReadItem, dest: torch.Tensor, offset: Optional[int] = None,
              dest_strides: tuple[int, ...] = ()) -> None:
        """``_read_many`` of one read."""
        self._read_many(((item, (dest, offset, dest_strides)),))

    def _read_many(self, reads: Iterable[tuple[ReadItem, _Region]]) -> None:
        """For each ``(item, (dest, offset, dest_strides))``, start filling ``dest`` with the
        item's slice: done, or pending in the batch that ``_finish_pending`` completes (a
        copy from the file's mapping, or a read that joins the previous one's ``preadv``
        because its bytes follow them in the file).

        With ``offset``, ``dest`` is the tensor of a region (``LoadPlanner.resolve_region``):
        the slice goes into ``dest.as_strided(item.lengths, dest_strides, offset)``, a
        view made only if the read needs one (not for a copy from a mapping).

        A chunk read for the first time is located and checked: its file's size and
        safetensors header agree with the metadata (and with ``verify`` the chunk's
        checksum); remembered in ``_chunks``.  In a file whose header matched its
        recorded digest the location comes from the metadata's columns alone, else the
        header entry is compared with the metadata's (``_checked_chunk``).

        One loop for all reads, the lookups inline: a resharded load of 2000 small
        tensors on 2 ranks makes 4000 reads a rank, each of a chunk not read before,
        and a function call costs about as much as a lookup's work.  Instructions a load
        of rank 0's half of 2000 × 128 KiB (valgrind, the difference of 5 and 2 loads; the
        machine's timings varied by more than the change), against a call to read, locate
        (through ``chunk_location``) and open for each read: resharded 573 -> 555 M, same
        layout 407 -> 398 M.
        """
        chunks, spans, handles, strides_of = self._chunks, self._spans, self._handles, self._strides
        adjacent, copies, device_reads = self._reads, self._copies, self._device_reads
        locate = self._chunk_locator()
        assert self.metadata is not None
        tensors = self.metadata.state_dict_metadata
        kept = self.files_kept
        mapped_min = direct_read.MAPPED_SLICE_MIN_BYTES
        spanned = 0
        try:
            for item, (dest, offset, dest_strides) in reads:
                index = item.storage_index
                key = (index.fqn, index.offset)
                chunk = chunks.get(key)
                where = None if chunk is not None or locate is None else locate(index)
                name = chunk[0] if chunk is not None else None if where is None else where[0]
                opened = None
                if name is not None:
                    # _open's lookup inline where it would not reorder the open files
                    opened = handles.get(name)
                    if opened is None or (len(handles) >= kept and opened is not self._latest):
                        opened = self._open(name)
                if chunk is None:
                    if where is not None and opened is not None and opened.trusted:
                        _, data_offset, sizes = where
                        strides = strides_of.get(sizes)
                        if strides is None:
                            strides = strides_of[sizes] = tuple(row_major_strides(sizes))
                        chunk = chunks[key] = (where[0], data_offset, sizes, strides,
                                               tensors[index.fqn].properties.dtype)  # type: ignore[union-attr]
                    else:
                        chunk = self._checked_chunk(index)
                        opened = self._open(chunk[0])
                assert opened is not None and chunk is not None
                _, data_offset, sizes, strides, dtype = chunk
                lengths = item.lengths
                # a model repeats a few (chunk shape, slice) pairs thousands of times: the
                # bounds check and the span arithmetic run once per pair
                geometry = spans.get((sizes, item.storage_offsets, lengths))
                if geometry is None:
                    geometry = self._slice_span(opened, item, sizes, strides)
                first, span, contiguous, count = geometry
                itemsize = dtype.itemsize
                if contiguous:
                    if offset is not None:
                        dest, offset = dest.as_strided(lengths, dest_strides, offset), None
                    if adjacent.add(opened.fd, opened.name, data_offset + first * itemsize, dest, dtype) or (
                            not dest.is_cpu
                            and device_reads.add(opened.fd, opened.name, data_offset + first * itemsize, dest, dtype)):
                        spanned += span * itemsize
                        continue
                # a column slice, or a row slice into a strided destination (a Shard(1) chunk
                # loaded as Shard(0)): copied from the mapping, not through a fresh span buffer
                if span and dest.is_cpu and span * itemsize >= mapped_min:
                    mapping = opened.mapped
                    if mapping is None and not opened.mapping_tried:
                        mapping = opened.mapping(self._arena or self._reserve_arena())
                    if mapping is not None:
                        if offset is not None:
                            if copies.add_region(dest, offset, dest_strides, mapping, dtype, data_offset, first, span,
                                                 lengths, strides, count * itemsize):
                                spanned += span * itemsize
                                continue
                        else:
                            start = mapping.slice_start(data_offset, dtype, first, span)
                            if start is not None:
                                copies.add_mapped(dest, mapping, dtype, start, lengths, strides, count * itemsize)
                                spanned += span * itemsize
                                continue
                if offset is not None:
                    dest = dest.as_strided(lengths, dest_strides, offset)
                spanned += read_slice(opened.fd, opened.name, data_offset, sizes, dtype, item.storage_offsets,
                                      lengths, dest, None, strides)[0]
        finally:
            self.bytes_read += spanned

    def _slice_span(self, opened: _OpenFile, item: ReadItem, sizes: tuple[int, ...],
                    strides: tuple[int, ...]) -> tuple[int, int, bool, int]:
        """``span_from_strides`` of ``item``'s slice of a stored chunk of shape ``sizes`` and
        its element count, remembered for the next slice of that shape; raises ``CheckpointFormatError`` when
        the slice does not lie inside the chunk."""
        offsets, lengths = item.storage_offsets, item.lengths
        if len(offsets) != len(sizes) or len(lengths) != len(sizes) or (
                lengths and any(map(gt, map(add, offsets, lengths), sizes))):
            raise CheckpointFormatError(
                f"{opened.path}: {item.storage_index.fqn!r} chunk at offsets "
                f"{list(item.storage_index.offset or ())}: requested region offsets={list(offsets)} "
                f"lengths={list(lengths)} exceeds the stored chunk of size {list(sizes)}"
            )
        first, span, contiguous = span_from_strides(strides, offsets, lengths)
        geometry = self._spans[(sizes, offsets, lengths)] = (first, span, contiguous, math.prod(lengths))
        return geometry

    def _finish_pending(self) -> None:
        """Complete every pending read and copy (before a file closes, before yielding)."""
        self._reads.flush()
        self._copies.flush()
        self._device_reads.flush()
        self._device_reads.wait()

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice, straight from the file.

        Checks the file's size and safetensors header against the metadata first (once
        per chunk), and with ``verify`` the checksum of the whole stored chunk (once per
        chunk); raises ``CorruptCheckpointError`` naming file, FQN and chunk on any
        disagreement.  The bytes go from the page cache into ``dest`` with ``preadv``
        when the slice is contiguous in the file, with one strided copy from a mapping
        of the file when it is a large column slice (see ``direct_read``).
        """
        try:
            self._read(item, dest)
        finally:
            self._finish_pending()

    def read_stream(self, reads: Iterable[ReadDestination]) -> Iterator[tuple[ReadItem, Any]]:
        """``read_into`` / ``read_object`` for each read in order, in batches of up to
        ``_BATCH_ITEMS`` reads or ``_BATCH_BYTES``: contiguous reads of adjacent file
        ranges go in one ``preadv``, column slices in one ``torch._foreach_copy_``; each
        batch is yielded, in order, once complete.  Per read this saves the system call
        and the copy's dispatch (2000 small tensors: ~10 us of ~25 us a read).  A subclass
        that overrides ``read_into`` or ``read_object`` gets the item-by-item default."""
        if not self._reads_alike():
            # a subclass that changes how one item is read (a bandwidth throttle, a
            # fault injection) still sees every read
            yield from super().read_stream(reads)
            return
        yield from self._batched((item, (dest, None, ())) for item, dest in reads)

    def _reads_alike(self) -> bool:
        """Whether ``read_into`` and ``read_object`` are this class's (a subclass that
        changes them reads item by item, through them)."""
        cls = type(self)
        return cls.read_into is FileSystemReader.read_into and cls.read_object is FileSystemReader.read_object

    def _batched(self, reads: Iterable[tuple[ReadItem, _Region]]) -> Iterator[tuple[ReadItem, Any]]:
        """``read_stream`` of ``(item, (destination, region offset, region strides))``
        (``_read_many``'s reads; destination ``None`` for an object): yields each read but
        those into a region, once its batch is complete."""
        batch: list[tuple[ReadItem, Any]] = []
        pending: list[tuple[ReadItem, _Region]] = []  # for _read_many
        count = nbytes = 0
        try:
            for read in reads:
                item, (dest, offset, _) = read
                if dest is None:
                    batch.append((item, self.read_object(item)))
                else:
                    pending.append(read)
                    if offset is None:
                        batch.append((item, dest))  # (item, its filled destination), as yielded
                        nbytes += dest.nbytes
                    # else filled in place: nothing to yield
                count += 1
                if count >= _BATCH_ITEMS or nbytes >= _BATCH_BYTES:
                    self._read_many(pending)
                    self._finish_pending()
                    yield from batch
                    batch, pending = [], []
                    count = nbytes = 0
            self._read_many(pending)
            self._finish_pending()
            yield from batch
        finally:
            # a stream left early drops its pending work: the mappings stay valid until
            # the reader closes its files, which finishes or drops the rest
            self._reads.clear()
            self._copies.clear()
            self._device_reads.clear()

    def read_object(self, item: ReadItem) -> Any:
        """The stored object; from a per-rank checkpoint, the copy this rank saved (SPEC §4)."""
        info = self._storage_info(item.storage_index)
        if self.metadata is not None and self.metadata.rank_objects:
            info = self.metadata.object_storage(item.storage_index.fqn, self.rank) or info
        file = self._root() / info.relative_path
        try:
            with open(file, "rb") as f:
                blob = os.pread(f.fileno(), info.length, info.offset)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint file {file} is missing") from None
        if len(blob) != info.length:
            raise CorruptCheckpointError(
                f"{item.storage_index.fqn!r}: {file} is truncated ({len(blob)} of {info.length} bytes at offset {info.offset})"
            )
        self.bytes_read += len(blob)
        if self.verify and info.checksum is not None and xxhash.xxh3_64_hexdigest(blob) != info.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {file}: object {item.storage_index.fqn!r} does not match its recorded xxh3"
            )
        return deserialize_object(blob, fqn=item.storage_index.fqn, file=str(file))

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """``read_items`` of this rank's items, in file order; reads into part of a plain
        tensor go to the planner's region (``resolve_region``): no view per read, and
        the row blocks of a column slice become one copy (``PendingCopies.add_region``)."""
        mine = [it for it in plan.items if it.source is None or it.source == self.rank]
        items = self.sort_items(mine)
        region = getattr(planner, "resolve_region", None)
        if region is None or not self._reads_alike():
            read_items(self, planner, items)
            return
        byte_io = LoadItemType.BYTE_IO
        tensors = [item for item in items if item.type is not byte_io]
        if len(tensors) < len(items):
            for item in items:
                if item.type is byte_io:
                    planner.load_bytes(item, self.read_object(item))
        # each tensor read paired with its region by C-level iterators (no Python step a read)
        commit_tensor = planner.commit_tensor
        for item, value in self._batched(zip(tensors, map(region, tensors))):
            commit_tensor(item, value)
