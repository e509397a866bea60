"""``ObjectStoreWriter``: the filesystem format's objects, streamed to a bucket.

Each rank streams its files through ``storage_fs.rank_files`` (same names, bytes and
checksums), large ones as multipart uploads.  The coordinator takes the lock object, deletes
the old ``.metadata`` first, then the old objects, and PUTs the new ``.metadata`` last.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Optional, Union

from hyper_parallel_dcp.core.metadata import Metadata, metadata_to_json
from hyper_parallel_dcp.core.planner import SavePlan, SavePlanner
from hyper_parallel_dcp.core.storage import StorageWriter, WriteResult
from hyper_parallel_dcp.storage_fs.incremental import reference_base
from hyper_parallel_dcp.storage_fs.layout import CHECKPOINT_FILE, METADATA_FILE, rank_metadata_file, stale_metadata
from hyper_parallel_dcp.storage_fs.rank_files import with_stored_as, write_rank_files

from .client import ObjectStore, ObjectStoreSettings
from .files import ObjectFiles
from .locks import ObjectLease, lock_key

__all__ = ["ObjectStoreWriter"]


class _UploadStream:
    """A write-only stream to one object, its parts uploaded by ``pool`` (a semaphore bounds them)."""

    def __init__(self, store: ObjectStore, key: str, pool: cf.ThreadPoolExecutor) -> None:
        self.store = store
        self.key = key
        self.pool = pool
        s = store.settings
        self.part_size = s.part_size
        self.threshold = s.multipart_threshold
        self._slots = threading.Semaphore(s.upload_concurrency + 1)
        self._held: list[bytearray] = []  # parts filled before the upload started
        self._buf: Optional[bytearray] = None
        self._fill = 0
        self._pos = 0
        self._upload_id: Optional[str] = None
        self._futures: list[cf.Future] = []

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        done = 0
        while done < n:
            if self._buf is None:
                self._slots.acquire()
                self._buf = bytearray(self.part_size)
                self._fill = 0
            k = min(self.part_size - self._fill, n - done)
            self._buf[self._fill:self._fill + k] = view[done:done + k]
            self._fill += k
            done += k
            if self._fill == self.part_size:
                self._part_full()
        self._pos += n
        return n

    def _part_full(self) -> None:
        assert self._buf is not None
        part, self._buf = self._buf, None
        if self._upload_id is None:
            self._held.append(part)
            if len(self._held) * self.part_size < self.threshold:
                return
            self._upload_id = self.store.start_upload(self.key)
            held, self._held = self._held, []
            for p in held:
                self._submit(p)
        else:
            self._submit(part)

    def _submit(self, part: Any, release: bool = True) -> None:
        number = len(self._futures) + 1
        upload_id = self._upload_id
        assert upload_id is not None

        def run() -> str:
            try:
                return self.store.upload_part(self.key, upload_id, number, part)
            finally:
                if release:
                    self._slots.release()

        self._futures.append(self.pool.submit(run))

    def finish(self) -> int:
        """Upload what is buffered and complete the object; returns its size."""
        tail = bytes(memoryview(self._buf)[:self._fill]) if self._buf is not None else b""
        if self._buf is not None:
            self._buf = None
            self._slots.release()
        if self._upload_id is None:
            body = b"".join([*self._held, tail]) if self._held else tail
            self._held = []
            self.store.put(self.key, body)
            return self._pos
        if tail:
            self._submit(tail, release=False)
        etags = [f.result() for f in self._futures]
        self.store.complete_upload(self.key, self._upload_id, etags)
        self._upload_id = None
        return self._pos

    def abort(self) -> None:
        for f in self._futures:
            f.cancel()
        cf.wait(self._futures)
        if self._upload_id is not None:
            try:
                self.store.abort_upload(self.key, self._upload_id)
            except Exception:  # noqa: BLE001 - the next save to this id removes it
                pass


class ObjectStoreWriter(StorageWriter):
    """Writes a checkpoint to ``s3://bucket/prefix`` (objects named as the files would be),
    ``settings`` tuning the transfers.  Without collectives each rank writes ``{rank}.metadata``."""

    def __init__(self, url: Union[str, None] = None, *, settings: Optional[ObjectStoreSettings] = None) -> None:
        self.settings = settings or ObjectStoreSettings()
        self.files: Optional[ObjectFiles] = None
        self.rank = 0
        self.world_size = 1
        self.is_coordinator = True
        self.atomic = True
        self._lock: Optional[ObjectLease] = None
        self.incremental_from: Optional[str] = None
        self.reset(url)

    def configure_save(self, *, incremental_from: Union[str, Any, None] = None, compression: Optional[str] = None) -> None:
        if compression is not None:
            raise ValueError(f"compression={compression!r}: compressed checkpoints are written to a filesystem only "
                             "for now (the object-store reader reads plain safetensors chunks)")
        self.incremental_from = None if incremental_from is None else str(incremental_from)

    def reset(self, checkpoint_id: Union[str, Any, None] = None) -> None:
        if checkpoint_id is not None:
            self.files = ObjectFiles(str(checkpoint_id), self.settings)

    @property
    def store(self) -> Optional[ObjectStore]:
        return None if self.files is None else self.files.store

    @property
    def prefix(self) -> str:
        return "" if self.files is None else self.files.prefix

    def _files(self) -> ObjectFiles:
        if self.files is None:
            raise ValueError("ObjectStoreWriter has no checkpoint URL: pass checkpoint_id or a URL")
        return self.files

    def set_up_storage_writer(self, *, is_coordinator: bool, rank: int = 0, world_size: int = 1,
                              use_collectives: bool = True) -> None:
        # Runs on every rank inside the save's first collective step: no rank writes data
        # before the coordinator has finished this.
        files = self._files()
        self.rank, self.world_size, self.is_coordinator = rank, world_size, is_coordinator
        self.atomic = use_collectives or world_size == 1
        if self.atomic:
            if is_coordinator:
                # the object-store flock: a second save to this id fails here, before it deletes anything
                self._release_lock()
                self._lock = ObjectLease(files.store, lock_key(files.prefix), what="save", target=str(files))
                self._lock.acquire()
                self.remove_checkpoint()
            return
        files.store.delete([files.key(n) for n in stale_metadata(files.names, rank, world_size)])

    def remove_checkpoint(self) -> None:
        """Delete the id's ``.metadata`` first, then its other checkpoint objects and
        unfinished uploads (an older checkpoint or an interrupted save's leftovers)."""
        files = self._files()
        names = [n for n in files.names() if CHECKPOINT_FILE.match(n)]
        if METADATA_FILE in names:  # first, alone: the id never has a .metadata describing other objects
            files.store.delete([files.key(METADATA_FILE)])
        # a fresh id (the manager's steps) costs the two listings only
        files.store.delete([files.key(n) for n in names if n != METADATA_FILE])
        files.store.abort_uploads(files.key(""))

    def _write_object(self, name: str, data_writer: Callable[[Any], Any], pool: cf.ThreadPoolExecutor) -> int:
        files = self._files()
        stream = _UploadStream(files.store, files.key(name), pool)
        try:
            data_writer(stream)
            return stream.finish()
        except BaseException:
            stream.abort()
            raise

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        files = self._files()
        base = None if self.incremental_from is None else reference_base(
            ObjectFiles(self.incremental_from, store=files.store), files)
        with cf.ThreadPoolExecutor(self.settings.upload_concurrency, thread_name_prefix="hp-dcp-upload") as pool:
            return write_rank_files(plan, planner, self.rank,
                                    lambda name, data_writer: self._write_object(name, data_writer, pool), base=base)

    def finalize_checkpoint(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Every rank's execute_write returned (all_reduce): each data object is complete.
        files = self._files()
        name = METADATA_FILE if self.atomic else rank_metadata_file(self.rank)
        if self._lock is not None:
            self._lock.check()
        files.store.put(files.key(name), metadata_to_json(with_stored_as(metadata)).encode())
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def abort(self, error: BaseException) -> None:
        """Release the save lock; nothing else to undo: no ``.metadata`` was written, and the
        next save to the id removes the rest."""
        self._release_lock()
