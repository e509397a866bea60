"""Collectives through tagged files in the checkpoint directory (``async_save(use_gloo=False)``),
each followed by a ``.done`` marker.  Exports :class:`FileMailbox`, :class:`MailboxTimeoutError`."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, TypeVar

from hyper_parallel_dcp.core.collectives import DistWrapper
from hyper_parallel_dcp.core.settings import DEFAULT_TIMEOUT_S, MAILBOX_POLL_MAX, phase
from hyper_parallel_dcp.storage_fs.atomic import write_file_atomic
from hyper_parallel_dcp.storage_fs.layout import DONE_SUFFIX, ack_file, gather_file, result_file, scatter_file

from . import safe_pickle

__all__ = ["FileMailbox", "MailboxTimeoutError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_FIRST_S = 0.001
# the back-off cap grows with the job (few ranks poll often, many bound their lookups)
_POLL_MAX_PER_RANK_S = 0.001
_POLL_MIN_CAP_S = 0.004
_MAX_POLL_THREADS = 32
#: The steps whose files :meth:`FileMailbox.finish` removes.
_STEPS = ("plan_cache", "plan", "write", "write-share", "write-confirm", "exchange", "barrier")


class MailboxTimeoutError(TimeoutError):
    """A rank's mailbox file did not appear in time (that rank's writer is gone or stuck)."""


class FileMailbox(DistWrapper):
    """A :class:`DistWrapper` whose object collectives go through files in ``directory``
    (``tag``: one per save); a read waits ``timeout`` s for a rank's file, then raises
    :class:`MailboxTimeoutError` naming the rank and the file."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, tag: str, *,
                 coordinator_rank: int = 0, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(None, use_dist=world_size > 1, coordinator_rank=coordinator_rank, rank=rank,
                         world_size=world_size, timeout=timeout)
        self._step = "exchange"  # the file names of collectives run outside a named step
        self.directory = Path(directory)
        self.tag = tag
        self.max_poll_s = min(MAILBOX_POLL_MAX.get(), max(_POLL_MIN_CAP_S, _POLL_MAX_PER_RANK_S * world_size))

    def _post(self, name: str, obj: Any) -> None:
        """Write ``name`` then its marker, each atomically (temp name + rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / name
        payload, marker = safe_pickle.dumps((self.tag, obj)), self.tag.encode()
        write_file_atomic(path, lambda f: f.write(payload), sync=False, unique_temp=True)
        write_file_atomic(path.with_name(name + DONE_SUFFIX), lambda f: f.write(marker), sync=False, unique_temp=True)

    def _fetch(self, name: str, rank: int) -> Any:
        """Poll for ``name`` of this save (its marker carries our tag) and read it safely."""
        path = self.directory / name
        marker = path.with_name(name + DONE_SUFFIX)
        deadline = time.monotonic() + self.timeout
        delay = _POLL_FIRST_S
        while True:
            with contextlib.suppress(FileNotFoundError):  # not written yet, or swapped away by the commit
                if marker.read_bytes().decode(errors="replace") == self.tag:
                    tag, obj = safe_pickle.loads(path.read_bytes(), source=str(path))
                    if tag == self.tag:
                        return obj
            if time.monotonic() > deadline:
                raise MailboxTimeoutError(
                    f"async save mailbox: rank {rank} did not write {path} within {self.timeout:.0f} s "
                    f"(its writer process died or is stuck); rank {self.rank} gives up"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.max_poll_s)

    def _fetch_all(self, names: list[tuple[str, int]]) -> list[Any]:
        # one polling thread per rank: a slow rank never delays reading the others
        with ThreadPoolExecutor(max_workers=min(_MAX_POLL_THREADS, len(names)),
                                thread_name_prefix="hp-dcp-mailbox") as pool:
            return [f.result() for f in [pool.submit(self._fetch, name, rank) for name, rank in names]]

    def _gather(self, step: str, obj: Any, to_all: bool) -> Optional[list[Any]]:
        """Post ``obj`` as this rank's file of ``step``; every rank's, on every rank (``to_all``) or the coordinator."""
        self._post(gather_file(step, self.rank), obj)
        if not (to_all or self.is_coordinator):
            return None
        return self._fetch_all([(gather_file(step, r), r) for r in range(self.world_size)])

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.use_dist:
            return [obj]
        with phase("all_gather_object", self.rank):
            return self._gather(self.exchange_name(), obj, True)  # type: ignore[return-value]

    def gather_object(self, obj: T) -> Optional[list[T]]:
        if not self.use_dist:
            return [obj]
        with phase("gather_object", self.rank):
            return self._gather(self.exchange_name(), obj, False)

    def scatter_object(self, objs: Optional[list[T]]) -> T:
        if not self.use_dist:
            assert objs is not None
            return objs[0]
        with phase("scatter_object", self.rank):
            if not self.is_coordinator:
                return self._fetch(scatter_file(self.exchange_name(), self.rank), self.coordinator_rank)
            assert objs is not None and len(objs) == self.world_size
            for r, obj in enumerate(objs):
                if r != self.rank:
                    self._post(scatter_file(self.exchange_name(), r), obj)
            return objs[self.rank]

    def broadcast_object(self, obj: Optional[T]) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        with phase("broadcast_object", self.rank):
            if not self.is_coordinator:
                return self._fetch(result_file(self.exchange_name()), self.coordinator_rank)
            self._post(result_file(self.exchange_name()), obj)
            return obj  # type: ignore[return-value]

    def barrier(self) -> None:
        if self.use_dist:
            self._gather("barrier", None, True)

    def finish(self, ack_timeout: float = 60.0) -> None:
        """Remove this save's mailbox files once every rank acknowledged the last answer (the
        coordinator waits ``ack_timeout`` s at most); a missing file is no error."""
        if not self.use_dist:
            return
        if not self.is_coordinator:
            self._post(ack_file(self.rank), None)
            return
        saved_timeout, self.timeout = self.timeout, ack_timeout
        try:
            self._fetch_all([(ack_file(r), r) for r in range(self.world_size) if r != self.rank])
        except MailboxTimeoutError as exc:
            logger.warning("async save mailbox clean-up in %s: %s", self.directory, exc)
        finally:
            self.timeout = saved_timeout
        ranks = range(self.world_size)
        for name in ([per_rank(step, r) for step in _STEPS for per_rank in (gather_file, scatter_file) for r in ranks]
                     + [result_file(step) for step in _STEPS] + [ack_file(r) for r in ranks]):
            self._remove_if_ours(name)

    def _remove_if_ours(self, name: str) -> None:
        path = self.directory / name
        marker = path.with_name(name + DONE_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            if marker.read_bytes().decode(errors="replace") != self.tag:
                return  # another (newer) save's file: not ours to delete
        for p in (path, marker):
            p.unlink(missing_ok=True)
