"""``ObjectSteps``: a checkpoint-manager root on object storage (``s3://bucket/run/step_N``).

A step is complete once its ``.metadata`` exists; a deletion removes ``.metadata`` first
under the step's save lock; a reader makes a mark, then checks for a fresh lock, a deletion
takes the lock, then checks for fresh marks (S3 is strongly consistent).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import re
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from hyper_parallel_dcp.core.backends import INFO_FILE, Leftover, StepEntry, parse_step_name, step_name
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, ConcurrentSaveError
from hyper_parallel_dcp.storage_fs.integrity import check_complete
from hyper_parallel_dcp.storage_fs.layout import METADATA_FILE, RANK_METADATA

from .client import ObjectStore, ObjectStoreError, ObjectStoreSettings, parse_url
from .files import ObjectFiles
from .locks import ObjectLease, holder_is_dead, is_stale, lock_key, readlock_prefix

__all__ = ["ObjectSteps"]

logger = logging.getLogger(__name__)

_HIDDEN = re.compile(r"^\.step_(0|[1-9][0-9]*)\.hp-dcp-(lock|readlock-[0-9a-f]+)$")


class ObjectSteps:
    """The ``step_N`` prefixes under an object-store ``root`` URL; touches no object there but
    those under ``step_N/`` and the hidden ``.step_N.hp-dcp-*`` ones."""

    def __init__(self, root: str, settings: Optional[ObjectStoreSettings] = None,
                 store: Optional[ObjectStore] = None) -> None:
        self._files = ObjectFiles(str(root), settings, store)
        self.store, self.prefix, self.root = self._files.store, self._files.prefix, self._files.target
        self._key = self._files.key

    def _step_prefix(self, step: int) -> str:
        return self._key(step_name(step))

    def _lock_key(self, step: int) -> str:
        return lock_key(self._step_prefix(step))

    def location(self, step: int) -> str:
        """The ``checkpoint_id`` that ``save``/``load`` use for ``step``."""
        return f"{self.root}/{step_name(step)}"

    def check_root(self) -> None:
        """Raise :class:`ObjectStoreError` naming the bucket when it does not exist or cannot be listed."""
        next(iter(self.store.list_objects(self._key(""), delimiter="/")), None)

    def list_steps(self) -> list[StepEntry]:
        """Every ``step_N/`` prefix, ascending by step (the ``.metadata`` HEADs several in flight)."""
        base = self._key("")
        found = sorted(step for key, size in self.store.list_objects(base, delimiter="/")
                       if size < 0 and (step := parse_step_name(key[len(base):].rstrip("/"))) is not None)
        with cf.ThreadPoolExecutor(min(16, len(found) or 1), thread_name_prefix="hp-dcp-steps") as pool:
            complete = list(pool.map(self.is_complete, found))
        return [StepEntry(step, self.location(step), done) for step, done in zip(found, complete)]

    def is_complete(self, step: int) -> bool:
        return self.store.size(f"{self._step_prefix(step)}/{METADATA_FILE}") is not None

    def completeness_problems(self, step: int) -> list[str]:
        """Why ``step`` would not load (metadata and object sizes, no data read); empty when fine."""
        report = check_complete(ObjectFiles(self.location(step), store=self.store))
        if report.complete and report.metadata is not None:
            return []
        return report.problems or [f"{self.location(step)} has no {METADATA_FILE}"]

    def _objects(self, step: int) -> list[tuple[str, int, float]]:
        """``(name relative to the step, size, modified)`` of every object under the step."""
        base = f"{self._step_prefix(step)}/"
        return [(key[len(base):], size, modified) for key, size, modified in self.store.list_modified(base)
                if size >= 0]

    def size_bytes(self, step: int) -> int:
        return sum(size for _, size, _ in self._objects(step))

    def saved_at(self, step: int) -> Optional[float]:
        """When the step was committed (``.metadata``'s Last-Modified), else its newest object's."""
        found = self.store.stat(f"{self._step_prefix(step)}/{METADATA_FILE}")
        if found is not None:
            return found[1]
        times = [modified for _, _, modified in self._objects(step)]
        return max(times) if times else None

    def read_info(self, step: int) -> Optional[dict[str, Any]]:
        """The step's ``hp-dcp-step.json`` (``{"step", "saved_at", "metrics"}``), or ``None``."""
        try:
            doc = json.loads(self.store.get(f"{self._step_prefix(step)}/{INFO_FILE}"))
        except (CheckpointNotFoundError, ValueError, UnicodeDecodeError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_info(self, step: int, info: dict[str, Any]) -> None:
        """PUT the step's info object before its save starts (not a checkpoint object: the save keeps it)."""
        self.store.put(f"{self._step_prefix(step)}/{INFO_FILE}", json.dumps(info, sort_keys=True).encode())

    def _fresh_readers(self, step: int) -> list[str]:
        stale_after = self.store.settings.lock_stale_after
        now = time.time()
        return [key for key, size, modified in self.store.list_modified(readlock_prefix(self._step_prefix(step)))
                if size >= 0 and not is_stale(modified, stale_after, now)]

    def remove_step(self, step: int) -> bool:
        """Delete every object of ``step`` (``.metadata`` first); False (nothing done) when a
        save into it or a :meth:`reading` of it is running, or it is gone already."""
        # the readers are checked after the lock is taken: see the module docstring
        return self._remove_locked(step, "deletion", lambda: not self._fresh_readers(step) and bool(self._objects(step)))

    def _remove_locked(self, step: int, what: str, still_wanted: Callable[[], bool]) -> bool:
        """Remove ``step``'s objects under its save lock if ``still_wanted()``; False when not removed."""
        lease = ObjectLease(self.store, self._lock_key(step), what=what, target=self.location(step))
        try:
            lease.acquire(wait=False)
        except ConcurrentSaveError:
            return False
        try:
            if not still_wanted():
                return False
            self._files.child(step_name(step)).remove()
            return True
        finally:
            lease.release()

    @contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """Hold ``step`` against :meth:`remove_step` (a reader mark; none without write access)
        while it is loaded.  Raises :class:`CheckpointNotFoundError` when the step is being
        deleted or written, or no longer complete."""
        mark = ObjectLease(self.store, readlock_prefix(self._step_prefix(step)) + uuid.uuid4().hex,
                           exclusive=False, what="read", target=self.location(step))
        try:
            mark.acquire()
        except ObjectStoreError as exc:
            logger.debug("no reader mark for %s: %s", self.location(step), exc)
            if not self.is_complete(step):
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} is not complete") from None
            yield
            return
        try:
            lock = self.store.stat(self._lock_key(step))
            if lock is not None and not is_stale(lock[1], self.store.settings.lock_stale_after):
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} is being deleted or written")
            if not self.is_complete(step):
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} was removed before it could be "
                                              "loaded")
            yield
        finally:
            mark.release()

    def _abandoned(self, key: str, modified: float, now: Optional[float] = None) -> bool:
        """The lock or mark at ``key`` is stale, or its holder ran on this machine and is gone."""
        if is_stale(modified, self.store.settings.lock_stale_after, now):
            return True
        try:
            doc = json.loads(self.store.get(key))
        except (CheckpointNotFoundError, ValueError, UnicodeDecodeError):
            return False
        return isinstance(doc, dict) and holder_is_dead(doc)

    def find_leftovers(self, *, protected: frozenset[int] = frozenset(), older_than: Optional[int] = None,
                       max_step: Optional[int] = None, grace: float = 0.0,
                       check_running: bool = True) -> list[Leftover]:
        """What dead saves left under ``root``, for steps not in ``protected``: dead holders'
        lock and mark objects (with ``check_running``), and a ``step_N/`` without ``.metadata``
        below ``older_than``, unlocked, unchanged for ``grace`` s and without ``{rank}.metadata``
        objects; nothing above ``max_step``.  ``check_running=False`` reads no lock."""
        base = self._key("")
        now = time.time()
        out: list[Leftover] = []
        entries = list(self.store.list_modified(base, delimiter="/"))
        locks = {}
        for key, size, modified in entries:
            hidden = _HIDDEN.match(key[len(base):]) if size >= 0 else None
            if hidden:
                locks[key] = modified
                of_step = int(hidden.group(1))
                kind = "lock" if hidden.group(2) == "lock" else "readlock"
                if (check_running and of_step not in protected and (max_step is None or of_step <= max_step)
                        and self._abandoned(key, modified, now)):
                    out.append(Leftover(of_step, kind, self.store.url(key), size))
        for key, size, _ in entries:
            step = parse_step_name(key[len(base):].rstrip("/")) if size < 0 else None
            if (step is None or (max_step is not None and step > max_step) or older_than is None
                    or step >= older_than or step in protected or self.is_complete(step)):
                continue  # is_complete: one HEAD, so a complete step's objects are not listed
            objects = self._objects(step)
            names = [name for name, _, _ in objects]
            if METADATA_FILE in names or not objects:
                continue
            if grace > 0 and now - max(modified for _, _, modified in objects) < grace:
                continue
            lock = self._lock_key(step)
            if check_running and lock in locks and not self._abandoned(lock, locks[lock], now):
                continue
            rank_local = [n for n in names if RANK_METADATA.match(n)]
            if rank_local:
                logger.warning("%s has no %s but holds a checkpoint saved without collectives (%s); left alone",
                               self.location(step), METADATA_FILE, ", ".join(sorted(rank_local)[:5]))
                continue
            out.append(Leftover(step, "incomplete", self.location(step), sum(size for _, size, _ in objects)))
        return sorted(out, key=lambda x: (x.step, x.kind, x.location))

    def remove_leftover(self, item: Leftover) -> bool:
        """Remove ``item`` (re-checked under the step's lock); False when it is in use or gone."""
        if item.kind in ("lock", "readlock"):
            key = parse_url(item.location)[2]
            found = self.store.stat(key)
            if found is None or not self._abandoned(key, found[1]):
                return False
            return self.store.delete_if(key, found[2])
        # not when a save completed it meanwhile
        return item.kind == "incomplete" and self._remove_locked(item.step, "clean-up",
                                                                 lambda: not self.is_complete(item.step))
