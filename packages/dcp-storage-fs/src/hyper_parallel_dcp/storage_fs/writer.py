"""``FileSystemWriter``: one safetensors file and one objects file per writing rank."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Optional, Union

from hyper_parallel_dcp.core.metadata import Metadata, metadata_to_json
from hyper_parallel_dcp.core.planner import SavePlan, SavePlanner
from hyper_parallel_dcp.core.storage import StorageWriter, WriteResult

from . import posix
from .atomic import PendingFile, fsync_dir, write_file_atomic, write_file_pending
from .commit import SaveLock, commit_directory, remove_stale_staging
from .incremental import reference_base
from .layout import METADATA_FILE, objects_file_name, rank_metadata_file, staging_dir, stale_metadata, tensors_file_name
from .rank_files import with_stored_as, write_rank_files

__all__ = ["FileSystemWriter"]


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint directory on a filesystem: atomically with a global view (in a
    staging directory swapped in once ``.metadata`` is there), else in place with
    ``{rank}.metadata`` each.  Files are fsynced on a thread unless ``sync_files=False``."""

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
        self.incremental_from: Optional[str] = None
        self.compression: Optional[str] = None

    def configure_save(self, *, incremental_from: Union[str, os.PathLike, None] = None,
                       compression: Optional[str] = None) -> None:
        self.incremental_from = None if incremental_from is None else os.fspath(incremental_from)
        self.compression = compression

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
        """Take the save lock (coordinator of an atomic save) once per save, inside a
        failure-propagating step so that a refusal is raised on every rank."""
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

    def data_writer(self, write: Any) -> Any:
        """What writes a data file through ``write(f)``: ``write`` (the bench's throttled writer wraps ``f``)."""
        return write

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        self._save_id = plan.save_id or "local"
        self._ensure_lock()  # a cached plan skips prepare_local_plan
        out_dir = self._data_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        if not self.atomic:
            for name in stale_metadata(lambda: os.listdir(out_dir), self.rank, self.world_size):
                (out_dir / name).unlink(missing_ok=True)
        # the page cache of the files this save replaces is freed to write into (the files
        # stay whole until the swap; docs/perf/storage.md)
        for name in (tensors_file_name(self.rank), objects_file_name(self.rank)):
            posix.drop_cache(self._target() / name)
        pending: list[PendingFile] = []

        def write_file(name: str, data_writer: Any) -> int:
            written = write_file_pending(out_dir / name, self.data_writer(data_writer))
            pending.append(written)
            return written.size

        started: list[_BackgroundSync] = []

        def start_sync() -> None:  # the fsyncs overlap the hashing and the metadata exchange
            started.append(_BackgroundSync(pending))
            self._syncing = started[0]

        base = None if self.incremental_from is None else reference_base(self.incremental_from, self._target())
        try:
            results = write_rank_files(plan, planner, self.rank, write_file,
                                       files_written=start_sync if self.sync_files else None, base=base,
                                       compression=self.compression)
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
        """Wait until ``execute_write``'s files are in place; raises the first ``OSError``, naming the file."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.wait()

    def prepare_finalize(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Serialise the metadata; in a staging directory also write it, not yet in place."""
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
        name = METADATA_FILE if self.atomic else rank_metadata_file(self.rank)
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
            with contextlib.suppress(OSError):
                self.sync_written()  # nothing may still be renaming into the directory removed below
            self._discard_prepared()
            if self.atomic and self.is_coordinator and self._save_id is not None:
                shutil.rmtree(self._data_dir(), ignore_errors=True)
        finally:
            self._release_lock()

    def __del__(self) -> None:  # a writer dropped mid-save must not keep the lock
        try:
            self._release_lock()
        except Exception:  # noqa: BLE001
            pass


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
