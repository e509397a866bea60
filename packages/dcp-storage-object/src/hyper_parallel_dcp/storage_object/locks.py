"""Save locks and reader marks on object storage: conditional PUTs where a filesystem has ``flock``.

A save lock ``.{leaf}.hp-dcp-lock`` is created ``If-None-Match: *`` (the loser raises
:class:`ConcurrentSaveError` naming the holder), rewritten every ``lock_refresh`` s ``If-Match``
its ETag, deleted after the commit, and taken over once stale or its local holder is gone.
Reader marks ``.{leaf}.hp-dcp-readlock-<token>`` work the same way.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from hyper_parallel_dcp.core.errors import ConcurrentSaveError

from .client import ObjectStore, ObjectStoreError

__all__ = ["ObjectLease", "holder_doc", "holder_is_dead", "is_stale", "lock_key"]

logger = logging.getLogger(__name__)


def lock_key(prefix: str) -> str:
    """The save lock's key for the checkpoint at ``prefix``: ``parent/.leaf.hp-dcp-lock``
    (reader marks are ``parent/.leaf.hp-dcp-readlock-<token>`` beside it)."""
    parent, _, leaf = prefix.rpartition("/")
    name = f".{leaf}.hp-dcp-lock" if leaf else ".hp-dcp-lock"
    return f"{parent}/{name}" if parent else name


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The start time (clock ticks since boot) of ``pid``, ``""`` when there is no such process."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def _machine() -> dict[str, str]:
    """Who can tell whether a holder is alive: the same host, boot and pid namespace."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def holder_is_dead(doc: dict) -> bool:
    """True when the lock's holder ran on this machine (same pid namespace and boot) and its process
    is gone; False when unknown (another machine, no ``/proc``): then only staleness tells."""
    here = _machine()
    if not here["pidns"] or not here["boot"] or any(doc.get(k) != v for k, v in here.items()):
        return False
    pid = doc.get("pid")
    return isinstance(pid, int) and _process_start(pid) != doc.get("start")


def holder_doc(store: ObjectStore, key: str) -> dict:
    """The document of the lock or mark at ``key``; ``{}`` when it is gone or not ours (holder unknown)."""
    try:
        doc = json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - gone meanwhile, or not ours: unknown holder
        return {}
    return doc if isinstance(doc, dict) else {}


def is_stale(modified: float, stale_after: float, now: Optional[float] = None) -> bool:
    """A lock or mark last rewritten at ``modified`` (epoch seconds) was left by a dead holder."""
    return (time.time() if now is None else now) - modified >= stale_after


class ObjectLease:
    """One lock object (``exclusive``: at most one holder) or reader mark, refreshed while held;
    ``what`` names the holder's purpose in messages."""

    def __init__(self, store: ObjectStore, key: str, *, exclusive: bool = True, what: str = "save",
                 target: str = "") -> None:
        self.store = store
        self.key = key
        self.exclusive = exclusive
        self.what = what
        self.target = target or store.url(key)
        self.token = uuid.uuid4().hex
        self.etag: Optional[str] = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._doc = {"token": self.token, "purpose": what, "pid": os.getpid(), "start": _process_start(os.getpid()),
                     "since": time.time(), **_machine()}

    def _body(self) -> bytes:
        # a new body (so a new ETag) at each renewal: that is how a waiting save sees a live holder
        return json.dumps({**self._doc, "renewed": time.time()}).encode()

    def _holder(self, doc: Optional[dict] = None) -> str:
        doc = holder_doc(self.store, self.key) if doc is None else doc
        if not doc:
            return "holder unknown"
        return f"{doc.get('purpose', 'save')} by pid {doc.get('pid')} on {doc.get('host')}"

    def acquire(self, wait: bool = True) -> None:
        """Create the object (exclusive: only when absent); with ``wait``, watch a lock found
        until it turns stale (taken over) or disappears.  Raises :class:`ConcurrentSaveError`
        naming the holder when a live holder has it (``wait=False``: at once)."""
        s = self.store.settings
        seen: Optional[str] = None
        deadline = time.monotonic() + s.lock_stale_after + s.lock_refresh
        while True:
            self.etag = self.store.put_if(self.key, self._body(), absent=self.exclusive)
            if self.etag is not None:
                break
            found = self.store.stat(self.key)
            if found is None:
                continue  # released meanwhile
            _, modified, etag = found
            if is_stale(modified, s.lock_stale_after):
                logger.warning("%s: taking over the lock %s, not renewed for %.0f s (its holder died)", self.target,
                               self.store.url(self.key), time.time() - modified)
                self.store.delete_if(self.key, etag)
                continue
            if seen is None:
                doc = holder_doc(self.store, self.key)
                if holder_is_dead(doc):  # a killed save on this machine: no need to wait for staleness
                    logger.warning("%s: taking over the lock %s of %s, which is no longer running", self.target,
                                   self.store.url(self.key), self._holder(doc))
                    self.store.delete_if(self.key, etag)
                    continue
            if not wait or (seen is not None and etag != seen) or time.monotonic() > deadline:
                raise ConcurrentSaveError(
                    f"another save into {self.target} is in progress ({self._holder()}; lock object "
                    f"{self.store.url(self.key)}); two saves into one id at once are refused")
            if seen is None:
                logger.info("%s: the lock %s is held (%s); waiting up to %.0f s to see whether its holder is alive",
                            self.target, self.store.url(self.key), self._holder(), s.lock_stale_after)
            seen = etag
            time.sleep(min(1.0, s.lock_refresh / 4))
        self._thread = threading.Thread(target=self._refresh, name="hp-dcp-lock-refresh", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        period = self.store.settings.lock_refresh
        while not self._stop.wait(period):
            try:
                etag = self.store.put_if(self.key, self._body(), etag=self.etag)
            except ObjectStoreError as exc:  # transient trouble: the next period tries again
                logger.warning("could not renew the lock %s: %s", self.store.url(self.key), exc)
                continue
            if etag is None:
                self.lost = True
                logger.error("lost the lock %s (taken over as stale): this %s will not commit",
                             self.store.url(self.key), self.what)
                return
            self.etag = etag

    def check(self) -> None:
        """Raise :class:`ConcurrentSaveError` when the lock was lost (taken over as stale)."""
        if self.lost:
            raise ConcurrentSaveError(f"the lock {self.store.url(self.key)} of {self.target} was taken over by "
                                      f"another save while this {self.what} ran (not renewed for "
                                      f"{self.store.settings.lock_stale_after} s); not committed")

    def release(self) -> None:
        """Stop renewing and delete the object (only while it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.etag is not None and not self.lost:
            try:
                self.store.delete_if(self.key, self.etag)
            except ObjectStoreError as exc:  # stale after lock_stale_after: the next save takes it over
                logger.warning("could not delete the lock %s: %s", self.store.url(self.key), exc)
        self.etag = None
