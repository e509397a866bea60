"""``ObjectSteps``: a checkpoint-manager root on object storage (``s3://bucket/run/step_N``).

A step is complete once its ``.metadata`` exists; a deletion removes ``.metadata`` first
under the step's save lock; a reader makes a mark, then checks for a fresh lock, a deletion
takes the lock, then checks for fresh marks (S3 is strongly consistent).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from hyper_parallel_dcp.core.backends import Leftover, StepStorage, step_name
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError
from hyper_parallel_dcp.storage_fs.integrity import check_complete

from .client import ObjectStore, ObjectStoreError, ObjectStoreSettings, parse_url
from .files import ObjectFiles
from .locks import ObjectLease, holder_doc, holder_is_dead, is_stale, lock_key

__all__ = ["ObjectSteps"]

logger = logging.getLogger(__name__)


class ObjectSteps(StepStorage):
    """The ``step_N`` prefixes under an object-store ``root`` URL; touches no object there but
    those under ``step_N/`` and the hidden ``.step_N.hp-dcp-*`` ones.  Locks and reader marks
    are :class:`ObjectLease` objects, left over once stale or their local holder is gone."""

    _probes_in_flight = 16

    def __init__(self, root: str, settings: Optional[ObjectStoreSettings] = None,
                 store: Optional[ObjectStore] = None) -> None:
        self._files = ObjectFiles(str(root), settings, store)
        self.store, self.prefix, self.root = self._files.store, self._files.prefix, self._files.target
        self._key = self._files.key

    def _step_prefix(self, step: int) -> str:
        return self._key(step_name(step))

    def _lock_key(self, step: int) -> str:
        return lock_key(self._step_prefix(step))

    def check_root(self) -> None:
        """Raise :class:`ObjectStoreError` naming the bucket when it does not exist or cannot be listed."""
        next(iter(self.store.list_objects(self._key(""), delimiter="/")), None)

    def _check_complete(self, step: int) -> Any:
        return check_complete(ObjectFiles(self.location(step), store=self.store))

    def _root_entries(self) -> list[tuple[str, str, bool]]:
        base = self._key("")
        return [(name, f"{self.root}/{name}", size < 0) for key, size in self.store.list_objects(base, delimiter="/")
                if (name := key[len(base):].rstrip("/"))]

    def _tree(self, location: str) -> list[tuple[str, int, float]]:
        base = parse_url(location)[2] + "/"
        return [(key[len(base):], size, modified) for key, size, modified in self.store.list_modified(base)
                if size >= 0]

    def _names(self, location: str) -> list[str]:
        base = parse_url(location)[2] + "/"
        return [key[len(base):].rstrip("/") for key, _ in self.store.list_objects(base, delimiter="/")]

    def _modified(self, step: int, name: str) -> Optional[float]:
        found = self.store.stat(f"{self._step_prefix(step)}/{name}")
        return None if found is None else found[1]

    def _read(self, step: int, name: str) -> Optional[bytes]:
        try:
            return self.store.get(f"{self._step_prefix(step)}/{name}")
        except CheckpointNotFoundError:
            return None

    def _write(self, step: int, name: str, data: bytes) -> None:
        self.store.put(f"{self._step_prefix(step)}/{name}", data)

    def _new_save_lock(self, step: int, what: str) -> tuple[Callable[[], None], Callable[[], None]]:
        lease = ObjectLease(self.store, self._lock_key(step), what=what, target=self.location(step))
        return functools.partial(lease.acquire, wait=False), lease.release

    @contextmanager
    def _readers_excluded(self, step: int) -> Iterator[bool]:
        """No fresh reader mark, checked after the lock is taken (a reader marks, then checks for a lock)."""
        stale_after = self.store.settings.lock_stale_after
        now = time.time()
        yield not any(size >= 0 and not is_stale(modified, stale_after, now) for _, size, modified
                      in self.store.list_modified(parse_url(self._beside(step, "readlock-"))[2]))

    @contextmanager
    def _read_hold(self, step: int) -> Iterator[bool]:
        """A reader mark (none without write access); :class:`CheckpointNotFoundError` when a
        fresh save lock shows the step being deleted or written."""
        mark = ObjectLease(self.store, parse_url(self._beside(step, "readlock-"))[2] + uuid.uuid4().hex,
                           exclusive=False, what="read", target=self.location(step))
        try:
            mark.acquire()
        except ObjectStoreError as exc:
            logger.debug("no reader mark for %s: %s", self.location(step), exc)
            yield False
            return
        try:
            lock = self.store.stat(self._lock_key(step))
            if lock is not None and not is_stale(lock[1], self.store.settings.lock_stale_after):
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} is being deleted or written")
            yield True
        finally:
            mark.release()

    def _delete(self, step: int) -> bool:
        if not self._tree(self.location(step)):
            return False
        self._files.child(step_name(step)).remove()
        return True

    def _abandoned(self, key: str, modified: float) -> bool:
        """The lock or mark at ``key`` is stale, or its holder ran on this machine and is gone."""
        return (is_stale(modified, self.store.settings.lock_stale_after)
                or holder_is_dead(holder_doc(self.store, key)))

    def _lock_held(self, location: str) -> bool:
        key = parse_url(location)[2]
        found = self.store.stat(key)
        return found is not None and not self._abandoned(key, found[1])

    def _remove_beside(self, item: Leftover) -> bool:
        key = parse_url(item.location)[2]
        found = self.store.stat(key) if item.kind in ("lock", "readlock") else None
        if found is None or not self._abandoned(key, found[1]):
            return False
        return self.store.delete_if(key, found[2])

    def _remove_files(self, locations: tuple[str, ...]) -> None:
        self.store.delete([parse_url(location)[2] for location in locations])
