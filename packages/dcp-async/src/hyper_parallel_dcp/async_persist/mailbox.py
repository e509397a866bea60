"""Collectives through files in the checkpoint directory (``async_save(use_gloo=False)``).

The writer processes of the ranks have no process group.  They exchange the save's two
rounds through files beside the checkpoint instead: every rank writes
``LOCAL_PLAN_{rank}.pkl`` (its local plan) and later ``STORAGE_DATA_{rank}.pkl`` (its
write results), each followed by a ``.done`` marker; the coordinator reads them with
parallel polling threads, and answers with hidden ``.hp-dcp-*`` files that the others
poll for.  Every file carries the save's ``tag`` (the same on all ranks, unique per
save), so files left by an earlier, killed save are never taken for this one's.  Files
are read with :mod:`.safe_pickle` — never running code — and removed once the
checkpoint has landed (the checkpoint commit swaps the directory, and the coordinator
deletes what is left after every rank acknowledged the result).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from hyper_parallel_dcp.core.collectives import DistWrapper
from hyper_parallel_dcp.core.settings import DEFAULT_TIMEOUT_S, MAILBOX_POLL_MAX
from hyper_parallel_dcp.core.timing import phase
from hyper_parallel_dcp.storage_fs.atomic import write_file_atomic
from hyper_parallel_dcp.storage_fs.mailbox_names import DONE_SUFFIX, ack_file, gather_file, result_file, scatter_file

from . import safe_pickle

__all__ = ["FileMailbox", "MailboxTimeoutError", "RankIdentity"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_DONE = DONE_SUFFIX
_POLL_FIRST_S = 0.001
# The back-off cap grows with the job: a few ranks poll often (the save lands within a few
# ms of the last file, where a fixed 50 ms cap added ~0.1 s per save on 2 ranks), while a
# large job on shared storage keeps the total rate of metadata lookups bounded.  The cap's
# ceiling is the setting HP_DCP_MAILBOX_POLL_MAX (default 50 ms).
_POLL_MAX_PER_RANK_S = 0.001
_POLL_MIN_CAP_S = 0.004
_MAX_POLL_THREADS = 32


class MailboxTimeoutError(TimeoutError):
    """A rank's mailbox file did not appear in time (that rank's writer is gone or stuck)."""


class RankIdentity(DistWrapper):
    """No exchange at all, but the rank and world size of the training process.

    The writer process has no process group, so without this a save with
    ``use_collectives=False`` would believe it is rank 0 of 1.
    """

    def __init__(self, rank: int, world_size: int):
        super().__init__(None, use_dist=False, rank=rank, world_size=world_size)


class FileMailbox(DistWrapper):
    """A :class:`DistWrapper` whose object collectives go through files in ``directory``.

    ``tag`` must be equal on all ranks for one save and differ between saves.  A read
    waits at most ``timeout`` seconds for a rank's file, then raises
    :class:`MailboxTimeoutError` naming the rank and the file.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, tag: str, *,
                 coordinator_rank: int = 0, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(None, use_dist=world_size > 1, coordinator_rank=coordinator_rank, rank=rank,
                         world_size=world_size, timeout=timeout)
        self._step = "exchange"  # the file names of collectives run outside a named step
        self.directory = Path(directory)
        self.tag = tag
        self.max_poll_s = min(MAILBOX_POLL_MAX.get(), max(_POLL_MIN_CAP_S, _POLL_MAX_PER_RANK_S * world_size))

    # -- naming ----------------------------------------------------------------------
    def _gather_name(self, rank: int) -> str:
        return gather_file(self.exchange_name(), rank)

    def _scatter_name(self, rank: int) -> str:
        return scatter_file(self.exchange_name(), rank)

    def _result_name(self) -> str:
        return result_file(self.exchange_name())

    # -- file I/O --------------------------------------------------------------------
    def _post(self, name: str, obj: Any) -> None:
        """Write ``name`` then its marker, each atomically (temp name + rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / name
        payload, marker = safe_pickle.dumps((self.tag, obj)), self.tag.encode()
        write_file_atomic(path, lambda f: f.write(payload), sync=False, unique_temp=True)
        write_file_atomic(path.with_name(name + _DONE), lambda f: f.write(marker), sync=False, unique_temp=True)

    def _fetch(self, name: str, rank: int) -> Any:
        """Poll for ``name`` of this save (its marker carries our tag) and read it safely."""
        path = self.directory / name
        marker = path.with_name(name + _DONE)
        deadline = time.monotonic() + self.timeout
        delay = _POLL_FIRST_S
        while True:
            try:
                if marker.read_bytes().decode(errors="replace") == self.tag:
                    tag, obj = safe_pickle.loads(path.read_bytes(), source=str(path))
                    if tag == self.tag:
                        return obj
            except FileNotFoundError:
                pass  # not written yet, or swapped away by the checkpoint commit meanwhile
            if time.monotonic() > deadline:
                raise MailboxTimeoutError(
                    f"async save mailbox: rank {rank} did not write {path} within {self.timeout:.0f} s "
                    f"(its writer process died or is stuck); rank {self.rank} gives up"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.max_poll_s)

    def _fetch_all(self, names: list[tuple[str, int]]) -> list[Any]:
        # One polling thread per rank: reading a slow rank never delays the others' reads.
        workers = min(_MAX_POLL_THREADS, len(names))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hp-dcp-mailbox") as pool:
            futures = [pool.submit(self._fetch, name, rank) for name, rank in names]
            return [f.result() for f in futures]

    # -- the object collectives DistWrapper's steps are made of --------------------------
    def all_gather_object(self, obj: T) -> list[T]:
        if not self.use_dist:
            return [obj]
        with phase("all_gather_object", self.rank):
            self._post(self._gather_name(self.rank), obj)
            return self._fetch_all([(self._gather_name(r), r) for r in range(self.world_size)])

    def gather_object(self, obj: T) -> Optional[list[T]]:
        if not self.use_dist:
            return [obj]
        with phase("gather_object", self.rank):
            self._post(self._gather_name(self.rank), obj)
            if not self.is_coordinator:
                return None
            return self._fetch_all([(self._gather_name(r), r) for r in range(self.world_size)])

    def scatter_object(self, objs: Optional[list[T]]) -> T:
        if not self.use_dist:
            assert objs is not None
            return objs[0]
        with phase("scatter_object", self.rank):
            if self.is_coordinator:
                assert objs is not None and len(objs) == self.world_size
                for r, obj in enumerate(objs):
                    if r != self.rank:
                        self._post(self._scatter_name(r), obj)
                return objs[self.rank]
            return self._fetch(self._scatter_name(self.rank), self.coordinator_rank)

    def broadcast_object(self, obj: Optional[T]) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        with phase("broadcast_object", self.rank):
            if self.is_coordinator:
                self._post(self._result_name(), obj)
                return obj  # type: ignore[return-value]
            return self._fetch(self._result_name(), self.coordinator_rank)

    def barrier(self) -> None:
        if self.use_dist:
            saved, self._step = self._step, "barrier"
            try:
                self.all_gather_object(None)
            finally:
                self._step = saved

    # -- steps: remember the step name, it picks the file names -----------------------------
    def reduce_scatter(self, step: str, map_fun: Callable[[], T], reduce_fun: Callable[[list[T]], list[R]]) -> R:
        self._step = step
        return super().reduce_scatter(step, map_fun, reduce_fun)

    def all_reduce(self, step: str, map_fun: Callable[[], T], reduce_fun: Callable[[list[T]], R]) -> R:
        self._step = step
        return super().all_reduce(step, map_fun, reduce_fun)

    def all_gather(self, step: str, map_fun: Callable[[], T]) -> list[T]:
        self._step = step
        return super().all_gather(step, map_fun)

    # -- clean-up ------------------------------------------------------------------------
    def finish(self, ack_timeout: float = 60.0) -> None:
        """Remove this save's mailbox files once every rank has read the last answer.

        Non-coordinators acknowledge; the coordinator waits for the acknowledgements (at
        most ``ack_timeout`` s: a rank that died cannot acknowledge) and then deletes every
        mailbox file of this save.  Never raises for a missing file.
        """
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
        for step in ("plan_cache", "plan", "write", "write-share", "write-confirm", "exchange", "barrier"):
            self._step = step
            names = [self._gather_name(r) for r in range(self.world_size)]
            names += [self._scatter_name(r) for r in range(self.world_size)] + [self._result_name()]
            for name in names:
                self._remove_if_ours(name)
        for r in range(self.world_size):
            self._remove_if_ours(ack_file(r))

    def _remove_if_ours(self, name: str) -> None:
        path = self.directory / name
        marker = path.with_name(name + _DONE)
        try:
            if marker.read_bytes().decode(errors="replace") != self.tag:
                return  # another (newer) save's file: not ours to delete
        except FileNotFoundError:
            pass
        for p in (path, marker):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
