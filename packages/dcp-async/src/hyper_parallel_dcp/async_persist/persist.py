"""``async_save``: stage now in the training process, persist in the writer process.

One :class:`_Persister` per training process owns the staging arena, the writer process
(spawned on first use, reused, restarted after it died) and the save in flight.  A save
is: wait for the previous one → stage (the only blocking part) → send the staged
description → a joining thread waits for the writer's reply (or its death), installs the
plan cache, runs the callback and resolves the future.  Neither the writer process nor
the joining thread is a daemon; at interpreter exit the save in flight completes before
the writer is told to stop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.connection as mp_connection
import multiprocessing.util as mp_util
import os
import signal
import threading
import time
import traceback
import uuid
import warnings
from typing import Any, Callable, Optional, Union

from hyper_parallel_dcp.core import settings
from hyper_parallel_dcp.core.backends import storage_writer_for, url_scheme
from hyper_parallel_dcp.core.errors import CheckpointError, CheckpointTimeoutError, describe_failures, format_ranks
from hyper_parallel_dcp.core.gc_pause import gc_paused
from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.pipeline import process_rank
from hyper_parallel_dcp.core.planner import SavePlanner
from hyper_parallel_dcp.core.save_planning import StandardSavePlanner
from hyper_parallel_dcp.core.stateful import expand_stateful
from hyper_parallel_dcp.core.storage import StorageWriter
from hyper_parallel_dcp.core.timing import phase

from .outcome import POLL_S, Outcomes
from .staging import StagingArena, StagingStats
from .writer import PING, CacheEntry, SaveReply, SaveRequest, cache_key, clean_planner, writer_main

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning", "AsyncSaveResponse", "async_save", "shutdown_writer",
           "staging_buffer_ptrs", "start_writer", "writer_pid"]

logger = logging.getLogger(__name__)

CheckpointId = Union[str, os.PathLike]

#: Seconds a writer waits for the other ranks (gloo group timeout, mailbox polling).
TIMEOUT_ENV = settings.ASYNC_TIMEOUT.name
#: Port of the writers' own gloo group; default ``MASTER_PORT + 1``.
GLOO_PORT_ENV = settings.ASYNC_GLOO_PORT.name
_SESSION_KEY = "hp_dcp_async_mailbox_session"


class AsyncSaveError(CheckpointError):
    """The background writer failed without a more specific error (e.g. it was killed),
    or the save failed on another rank (the message names it)."""


class AsyncSaveFailureWarning(RuntimeWarning):
    """An earlier ``async_save`` failed and nobody looked at its response.

    Issued by the next ``async_save`` on that rank (the failure was also logged at the
    time); that next save goes ahead.
    """


class _Future(concurrent.futures.Future):
    """A future that remembers whether its outcome was looked at."""

    observed = False

    def result(self, timeout: Optional[float] = None) -> Any:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.observed = True
        return super().exception(timeout)

    def peek_exception(self) -> Optional[BaseException]:
        """The exception of a done future, without counting as looked at."""
        return concurrent.futures.Future.exception(self, 0) if self.done() else None


class AsyncSaveResponse:
    """Handle of one async save.

    ``persist_completion`` is a ``concurrent.futures.Future[Metadata]`` resolved once the
    checkpoint has landed (after ``callback`` ran), or failed with the writer's error.
    ``staging`` says what staging did (bytes copied, reused, allocated); ``cache_hit``
    becomes True/False once landed when the standard planner was used; ``writer_pid`` is
    the writer process's pid.
    """

    def __init__(self, checkpoint_id: Optional[str], staging: StagingStats, writer_pid: int):
        self.persist_completion: concurrent.futures.Future[Metadata] = _Future()
        self.persist_completion.set_running_or_notify_cancel()  # a landing save cannot be cancelled
        self.checkpoint_id = checkpoint_id
        self.staging = staging
        self.writer_pid = writer_pid
        self.cache_hit: Optional[bool] = None
        self._thread: Optional[threading.Thread] = None

    def get_result(self, timeout: Optional[float] = None) -> Metadata:
        """``persist_completion.result(timeout)``: the global metadata once landed.

        Raises the writer's error (original message), :class:`AsyncSaveError` when the
        writer died, or ``concurrent.futures.TimeoutError``.
        """
        return self.persist_completion.result(timeout)

    def done(self) -> bool:
        return self.persist_completion.done()

    def _failure(self) -> Optional[BaseException]:
        future = self.persist_completion
        return future.peek_exception() if isinstance(future, _Future) else None

    def __repr__(self) -> str:
        state = "landed" if self.done() and self._failure() is None else (
            "failed" if self.done() else "in flight")
        return f"AsyncSaveResponse({self.checkpoint_id!r}, {state})"


def _timeout_s() -> float:
    return settings.ASYNC_TIMEOUT.get()


#: How much lower (``nice``) the writer process runs than the training process.
_WRITER_NICE = 10

#: Seconds the training process waits for its writer beyond the writer's own timeouts.
_REPLY_GRACE_S = 60.0


def _gloo_init_method() -> str:
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not (addr and port):
        # An AssertionError, as the user guide documents, but raised explicitly: ``python -O``
        # strips assert statements, and this checks the user's environment, not our code.
        raise AssertionError(
            "async_save(use_gloo=True) builds a CPU gloo group in the writer processes and needs the "
            "MASTER_ADDR and MASTER_PORT environment variables (the writers use MASTER_PORT + 1, or "
            f"{GLOO_PORT_ENV})"
        )
    gloo_port = settings.ASYNC_GLOO_PORT.get()
    if not gloo_port:  # unset: next to the training job's own port
        try:
            gloo_port = int(port) + 1
        except ValueError:
            raise settings.SettingError(f"MASTER_PORT={port!r} is not a port number") from None
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"tcp://{host}:{gloo_port}"


def _remote_failure(message: str, failed: dict[int, str]) -> AsyncSaveError:
    """This rank's part went well (or was stopped) but the save failed on other ranks."""
    exc = AsyncSaveError(message)
    exc.failed_ranks = tuple(sorted(failed))  # type: ignore[attr-defined]
    return exc


class _Persister:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arena = StagingArena()
        self.proc: Any = None
        self.conn: Any = None
        self.child_slabs: set[int] = set()
        #: the staged layout whose tensor leaves the writer holds (see StagedStateDict.layout_id)
        self.child_layout: Optional[int] = None
        #: plan-cache key -> the entry object of this process's cache that the writer holds too
        self.child_cache: dict[Any, Any] = {}
        #: the writer was started but has no request yet (it may still be importing torch)
        self.writer_fresh = False
        self.inflight: Optional[AsyncSaveResponse] = None
        self.last: Optional[AsyncSaveResponse] = None
        self.seq = 0
        #: seq of the last coordinated save that failed on some rank; the next one first
        #: waits until every rank's writer of that save is gone (resynchronisation)
        self.failed_seq: Optional[int] = None
        self.session: Optional[str] = None
        self._exit_hook: Any = None

    # -- the writer process --------------------------------------------------------------
    def _ensure_process(self) -> bool:
        """Start the writer process unless one is alive; True when it was just started."""
        if self.proc is not None and self.proc.is_alive():
            return False
        self._discard_process()
        import torch.multiprocessing as tmp  # registers the shared-memory tensor reductions

        ctx = tmp.get_context("spawn")  # never fork: the child must not inherit CUDA/NCCL state
        parent_end, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=writer_main, args=(child_end, os.getpid()), name="hp-dcp-async-writer",
                           daemon=False)
        proc.start()
        child_end.close()
        try:
            # Lower the writer's CPU priority at once: its start (importing torch, 1-2 s of
            # CPU) overlaps the first save's staging, and on a busy host it took the cores
            # the training processes stage on (2 ranks on 2 cores: first-save blocking 3x a
            # clone).  The writer only persists in the background; training comes first.
            assert proc.pid is not None  # started; pid 0 would mean this process
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + _WRITER_NICE))
        except OSError as exc:  # the process is already gone, or priorities are not ours to set
            logger.debug("async_save: cannot lower the writer's priority: %s", exc)
        self.proc, self.conn = proc, parent_end
        self.child_slabs = set()
        self.child_layout = None
        self.child_cache = {}
        self.writer_fresh = True
        if self._exit_hook is None:
            # Runs inside multiprocessing's exit handler *before* it joins non-daemon
            # children (which would otherwise wait forever for our idle writer).
            self._exit_hook = mp_util.Finalize(None, self.shutdown, exitpriority=100)
        return True

    def _discard_process(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        if self.proc is not None:
            self.proc.join(timeout=0)
        self.proc = self.conn = None
        self.child_slabs = set()
        self.child_layout = None

    def _wait_inflight(self) -> None:
        response = self.inflight
        if response is None:
            return
        thread = response._thread
        if thread is threading.current_thread():
            raise RuntimeError("async_save cannot be called from the callback of the save in flight")
        if thread is not None:
            thread.join()
        self.inflight = None

    def _surface_dropped(self) -> None:
        """Warn about the previous save's failure if nobody looked at its response."""
        last, self.last = self.last, None
        if last is None:
            return
        future = last.persist_completion
        exc = last._failure()
        if exc is not None and isinstance(future, _Future) and not future.observed:
            future.observed = True
            warnings.warn(AsyncSaveFailureWarning(
                f"the previous async_save{' into ' + last.checkpoint_id if last.checkpoint_id else ''} failed and "
                f"its response was never checked: {type(exc).__name__}: {exc}"), stacklevel=4)

    def prestart(self, wait: bool = False, timeout: Optional[float] = None) -> None:
        """Start the writer process now unless one is running (see :func:`start_writer`)."""
        with self._lock:
            self._ensure_process()
            if not wait or not self.writer_fresh:
                return
            self._wait_inflight()
            ready: list[Any] = []
            try:
                self.conn.send(PING)
                ready = mp_connection.wait([self.conn, self.proc.sentinel], timeout)
                answer = self.conn.recv() if self.conn in ready else None
            except (EOFError, OSError):
                answer = None
            if answer != PING:
                if ready:
                    # its end of the pipe closed, or it exited: not a timeout, even while
                    # its exit status is not there yet
                    self.proc.join(timeout=5)
                if not self.proc.is_alive():
                    raise AsyncSaveError(_death_message(self.proc, None, starting=True, saving=False))
                raise CheckpointTimeoutError(
                    f"the async writer process (pid {self.proc.pid}) was not ready within {timeout} s",
                    "start_writer", ())
            self.writer_fresh = False

    def shutdown(self) -> None:
        """Wait for the save in flight, then stop the writer process and free the staging memory."""
        with self._lock:
            try:
                self._wait_inflight()
            except RuntimeError:
                pass
            if self.conn is not None and self.proc is not None and self.proc.is_alive():
                try:
                    self.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                self.proc.join(timeout=settings.ASYNC_SHUTDOWN_TIMEOUT.get())
                if self.proc.is_alive():
                    self.proc.terminate()
                    self.proc.join(timeout=10)
            self._discard_process()
            self.arena.clear()

    def _mailbox_session(self) -> str:
        """A token equal on all ranks and new for each training job (via the job's store).

        Every rank proposes one and the store keeps the first (``compare_set``, one round
        trip): no rank waits for another.  When rank 0 set it and the others read it, a
        rank that asked first waited 10 ms in the store's ``get`` on the first save's
        blocking path; and the first ranks of two sub-groups saving at once (pipeline
        stages) both set it, so members of one group could read different tokens.  Keyed
        by the elastic restart count: a restarted job gets a new one.
        """
        if self.session is None:
            token = ""
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    store = dist.distributed_c10d._get_default_store()
                    key = f"{_SESSION_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                    stored = store.compare_set(key, "", uuid.uuid4().hex[:12])
                    token = stored.decode() if isinstance(stored, bytes) else str(stored)
            except Exception as exc:  # noqa: BLE001 - fall back to the launcher's run id
                logger.debug("async_save: no store for the mailbox session token: %s", exc)
            self.session = token or os.environ.get("TORCHELASTIC_RUN_ID", "") or "job"
        return self.session

    def _board(self, rank: int, world_size: int, process_group: Any = None) -> Optional[Outcomes]:
        """The outcome board of a coordinated save (``None`` without a job store).

        Keyed by the group's global ranks too: sub-groups that save at once (pipeline
        stages) each have their own board.
        """
        try:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
            group = "world" if process_group is None else ",".join(
                map(str, dist.get_process_group_ranks(process_group)))
        except Exception as exc:  # noqa: BLE001 - no process group: no cross-rank outcomes
            logger.debug("async_save: no job store for the outcome board: %s", exc)
            return None
        return Outcomes(store, f"{self._mailbox_session()}/{group}", rank, world_size)

    def _retire(self, proc: Any, seq: int, board: Optional[Outcomes]) -> None:
        """Stop this save's writer (it may be stuck waiting for a dead peer) and say so."""
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        if board is not None:
            board.publish_retired(seq)
            self.failed_seq = seq

    # -- one save ------------------------------------------------------------------------
    def submit(self, state_dict: dict[str, Any], *, checkpoint_id: Optional[CheckpointId],
               storage_writer: Optional[StorageWriter], planner: Optional[SavePlanner], no_dist: bool,
               use_collectives: bool, use_gloo: bool, callback: Optional[Callable[[], None]],
               process_group: Any = None) -> AsyncSaveResponse:
        with self._lock:
            self._wait_inflight()
            self._surface_dropped()
            # Counted first, on every call: the same number on every rank, even when this
            # call fails here on some ranks only; it names the save in the job's store.
            self.seq += 1
            seq = self.seq
            use_collectives = use_collectives and not no_dist
            rank, world_size = (0, 1) if no_dist else process_rank(process_group)
            board = self._board(rank, world_size, process_group) if use_collectives and world_size > 1 else None
            try:
                if board is not None and self.failed_seq is not None:
                    # After a failed save: every rank's writer of that save must be gone
                    # before new writers meet (a survivor's would wait for a dead peer).
                    board.wait_all(self.failed_seq, "retired", time.monotonic() + _timeout_s(), "resynchronise")
                    self.failed_seq = None
                # Staging a new layout allocates tens of thousands of small objects: a full
                # collection they trigger re-traverses the training process's heap (100+ ms
                # measured on the blocking path of a 2000-tensor first save); the sync save
                # pauses the collector for the same reason.
                with gc_paused():
                    state_dict, _ = expand_stateful(state_dict)  # torch's Stateful leaves: their state_dict()
                    return self._submit(seq, board, state_dict, checkpoint_id, storage_writer, planner, no_dist,
                                        use_collectives, use_gloo, callback, rank, world_size, process_group)
            except BaseException as exc:
                if board is not None:
                    board.publish_failure(seq, f"{type(exc).__name__}: {exc}")
                    self._retire(self.proc, seq, board)
                raise

    def _submit(self, seq: int, board: Optional[Outcomes], state_dict: dict[str, Any],
                checkpoint_id: Optional[CheckpointId], storage_writer: Optional[StorageWriter],
                planner: Optional[SavePlanner], no_dist: bool, use_collectives: bool, use_gloo: bool,
                callback: Optional[Callable[[], None]], rank: int, world_size: int,
                process_group: Any = None) -> AsyncSaveResponse:
        gloo_init = mailbox_dir = None
        if use_gloo and use_collectives:
            gloo_init = _gloo_init_method()
        writer = storage_writer_for(checkpoint_id, storage_writer, caller="async_save")
        if no_dist or world_size == 1:
            mode = "local"
        elif not use_collectives:
            mode = "none"
        elif use_gloo:
            mode = "gloo"
        else:
            target = checkpoint_id if checkpoint_id is not None else getattr(writer, "path", None)
            if target is None:
                raise ValueError("async_save(use_gloo=False) exchanges plans through the checkpoint "
                                 "directory and needs checkpoint_id")
            if url_scheme(target) != "file":
                raise ValueError(f"async_save(use_gloo=False) on several ranks exchanges plans through files in "
                                 f"the checkpoint directory; {target} is not a local path: pass use_gloo=True")
            mailbox_dir = str(target)
            mode = "files"
        tag = f"{self._mailbox_session()}-{seq}" if mode == "files" else ""

        proc = self.proc
        if self.writer_fresh and proc is not None and not proc.is_alive() and (proc.exitcode or 0) > 0:
            # start_writer()'s writer exited of an error of its own before any request (its
            # traceback on stderr): most often spawn running an unguarded training script
            # again, which a new writer would repeat.  Said now, not by the next save
            # (CheckpointManager's first save interval later); one killed by a signal is
            # replaced below.
            self._discard_process()
            self.writer_fresh = False
            raise AsyncSaveError(_death_message(proc, None, starting=True, saving=False)
                                 + f" async_save into {checkpoint_id or 'the storage writer'} was not started.")
        # Started first: the child imports torch while we stage.  A writer that has not had
        # a request yet (just started, or by start_writer()) may still be importing torch.
        started = self._ensure_process() or self.writer_fresh
        self.writer_fresh = False
        with phase("build_staged_state_dict", rank):
            # Pieces that need a new slab are cloned into private memory and the joining
            # thread fills the slab (allocating it and writing fresh shared pages: 0.067 s
            # CPU against a clone's 0.056 for 2000 x 64 KiB, medians of 6); then it also
            # sends the request, which needs that slab.
            staged, stats = self.arena.stage(state_dict, defer_new_slab=True)
        defer_send = started or self.arena.has_pending

        planner_copy = clean_planner(planner)
        cache = self._cache_to_send(planner_copy, staged.leaves.keys(), mode, rank, world_size,
                                    use_collectives)
        # A writer holding this layout's tensor leaves gets the object leaves only.
        layout_held = not started and staged.layout_id is not None and staged.layout_id == self.child_layout
        request = SaveRequest(
            seq=seq, staged=staged.without_tensors() if layout_held else staged, new_slabs={},
            storage_writer=writer, planner=planner_copy, mode=mode,
            rank=0 if mode == "local" else rank, world_size=1 if mode == "local" else world_size,
            no_dist=no_dist, use_collectives=use_collectives, gloo_init=gloo_init,
            mailbox_dir=mailbox_dir, mailbox_tag=tag, timeout_s=_timeout_s(), cache=cache,
            cache_held=cache is not None and cache[1] is not None and self.child_cache.get(cache[0]) is cache[1],
            save_suffix=f"-a{seq}",
        )
        if request.cache_held:
            request.cache = (cache[0], None)  # type: ignore[index]
        # A request larger than the pipe buffer blocks until the writer reads it; a writer
        # started by this save is still importing torch (1-2 s), so the joining thread
        # sends it instead of the caller (2000 tensors: first-save blocking 1.4 s -> the
        # staging copy alone).
        deferred: Optional[SaveRequest] = request if defer_send else None
        #: the slabs the writer holds before this request (a fresh writer holds none)
        held = frozenset() if started else frozenset(self.child_slabs)
        failed_send: Optional[BaseException] = None
        if not defer_send:
            request.new_slabs = {i: t for i, t in self.arena.slabs.items() if i not in self.child_slabs}
            with phase("send_to_writer", rank):
                try:
                    self.conn.send(request)  # pickled whole before any byte is written
                    self._note_cache_sent(cache)
                except (BrokenPipeError, ConnectionError, OSError):
                    # the writer died between saves: start a fresh one, which needs every
                    # slab and the whole cache entry, and let the joining thread send to it
                    self._discard_process()
                    self._ensure_process()
                    self.writer_fresh = False  # this request is its first
                    request.cache, request.cache_held = cache, False
                    request.staged = staged
                    deferred, held = request, frozenset()
                except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable leaf: fails the future
                    failed_send = exc
        if failed_send is None:
            # What the writer holds once the request arrives.  A request that could not be
            # sent never changes this (the next save sends those slabs again).
            self.child_slabs = set(staged.slab_ids)
            self.child_layout = staged.layout_id
        response = AsyncSaveResponse(None if checkpoint_id is None else str(checkpoint_id), stats,
                                     self.proc.pid)
        response._thread = threading.Thread(
            target=self._join,
            args=(response, self.proc, self.conn, seq, cache, planner, callback, deferred, held, board, failed_send,
                  started),
            name=f"hp-dcp-async-join-{seq}", daemon=False,
        )
        response._thread.start()
        self.inflight = self.last = response
        return response

    def _note_cache_sent(self, cache: Optional[CacheEntry]) -> None:
        """The writer now holds ``cache`` (sent whole, or held already)."""
        if cache is not None and cache[1] is not None:
            self.child_cache[cache[0]] = cache[1]

    @staticmethod
    def _cache_to_send(planner: Optional[SavePlanner], keys: Any, mode: str, rank: int, world_size: int,
                       use_collectives: bool) -> Optional[CacheEntry]:
        """The parent's plan-cache entry for this save, to mirror into the writer.

        The writer gives the ``save_id`` of a cached plan a suffix from the save sequence
        number (equal on all ranks), so a writer restarted after a crash never reuses the
        staging directory name of an earlier save.
        """
        if not use_collectives:
            return None
        probe = planner if planner is not None else StandardSavePlanner()
        if not isinstance(probe, StandardSavePlanner) or not probe.enable_plan_caching:
            return None
        r, w = (0, 1) if mode == "local" else (rank, world_size)
        return probe.plan_cache.export(cache_key(probe, keys, r, w, use_collectives))

    def _join(self, response: AsyncSaveResponse, proc: Any, conn: Any, seq: int, sent: Optional[CacheEntry],
              planner: Optional[SavePlanner], callback: Optional[Callable[[], None]],
              deferred: Optional[SaveRequest] = None, held: frozenset[int] = frozenset(),
              board: Optional[Outcomes] = None, failed_send: Optional[BaseException] = None,
              fresh: bool = False) -> None:
        """The save's second half, on its joining thread: send a deferred request, await the
        writer's reply, settle the future.  ``fresh``: the writer was started for this save."""
        future = response.persist_completion
        sent_ok = failed_send is None
        try:
            if failed_send is not None:
                raise failed_send
            if deferred is not None:
                self.arena.complete()  # a new slab deferred by stage(): filled off the caller's path
                deferred.new_slabs = {i: t for i, t in self.arena.slabs.items() if i not in held}
                try:
                    conn.send(deferred)
                    if not deferred.cache_held:
                        self._note_cache_sent(deferred.cache)
                except (BrokenPipeError, ConnectionError, OSError):
                    sent_ok = False
                    proc.join(timeout=5)
                    raise AsyncSaveError(_death_message(proc, response.checkpoint_id, starting=fresh)) from None
                except BaseException:
                    sent_ok = False
                    raise
            reply = _await_reply(proc, conn, board, seq, time.monotonic() + _timeout_s() + _REPLY_GRACE_S)
            if reply is None:
                proc.join(timeout=5)
                raise AsyncSaveError(_death_message(proc, response.checkpoint_id, starting=fresh))
            if reply.seq != seq:
                raise AsyncSaveError(f"async writer answered save #{reply.seq}, expected #{seq}")
            if reply.metadata is None:
                exc = reply.error if reply.error is not None else AsyncSaveError(reply.error_text)
                if reply.error is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"raised in the async writer process (pid {proc.pid}):\n{reply.error_text}")
                if board is not None:
                    # Our writer's error may only be the echo of a peer's death ("connection
                    # closed by peer"): when another rank reports its failure, name that rank.
                    failed = _others_failed(board, seq, time.monotonic() + _ECHO_WAIT_S)
                    if failed:
                        raise _remote_failure(_remote_message(seq, failed, response.checkpoint_id,
                                                              landed_here=False), failed) from exc
                raise exc
            if board is not None:
                # Landed here; it is a success only if it landed on every rank.
                board.publish_ok(seq)
                failed = board.wait_all(seq, "ok", time.monotonic() + _timeout_s(), "finish")
                if failed:
                    raise _remote_failure(_remote_message(seq, failed, response.checkpoint_id, landed_here=True), failed)
            response.cache_hit = reply.cache_hit
            if planner is not None and reply.cache_hit is not None:
                planner.cache_hit = reply.cache_hit
            if reply.cache is not None and not reply.cache_hit:
                StandardSavePlanner.plan_cache.install(reply.cache)
                self._note_cache_sent(StandardSavePlanner.plan_cache.export(reply.cache[0]))
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the future
            logger.error("async_save #%d%s failed on rank %s: %s: %s", seq,
                         f" into {response.checkpoint_id}" if response.checkpoint_id else "",
                         board.rank if board is not None else "-", type(exc).__name__, exc)
            if board is not None and not hasattr(exc, "failed_ranks"):
                board.publish_failure(seq, "".join(traceback.format_exception_only(type(exc), exc)).strip())
            if board is not None or not sent_ok:
                # a writer of a failed coordinated save may wait for a dead peer, and one
                # that missed a request holds other slabs than we think: start afresh
                self._retire(proc, seq, board)
            # whatever failed, the next save sends its whole staged description (the next
            # submit joins this thread before it looks)
            self.child_layout = None
            future.set_exception(exc)
            return
        if callback is not None:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the checkpoint has landed; a callback bug must not hide that
                logger.exception("async_save callback raised (the checkpoint %s has landed)", response.checkpoint_id)
        future.set_result(reply.metadata)


#: Seconds a rank whose writer failed looks for a peer's failure that caused it.
_ECHO_WAIT_S = 1.0


def _others_failed(board: Outcomes, seq: int, until: float) -> dict[int, str]:
    while True:
        failed = board.failures(seq)
        failed.pop(board.rank, None)
        if failed or time.monotonic() > until:
            return failed
        time.sleep(POLL_S)


def _remote_message(seq: int, failed: dict[int, str], checkpoint_id: Optional[str], landed_here: bool) -> str:
    where = f" into {checkpoint_id}" if checkpoint_id else ""
    here = ("this rank's part had landed, but the checkpoint is not trusted" if landed_here else
            "this rank's writer was stopped")
    return (f"async save #{seq}{where} failed on rank(s) [{format_ranks(failed)}]; {here}. The next async_save "
            f"starts new writer processes on every rank.\n{describe_failures(failed)}")


def _await_reply(proc: Any, conn: Any, board: Optional[Outcomes] = None, seq: int = 0,
                 deadline: Optional[float] = None) -> Optional[SaveReply]:
    """The writer's reply, or ``None`` if the writer died first.

    With a ``board``, raises :class:`AsyncSaveError` as soon as another rank reports a
    failure of save ``seq`` (a dead writer there: ours would wait for it); raises
    :class:`CheckpointTimeoutError` once ``deadline`` passes without a reply.
    """
    while True:
        timeout = POLL_S if board is not None else 1.0
        ready = mp_connection.wait([conn, proc.sentinel], timeout=timeout)
        if conn in ready:
            try:
                return _recv_reply(conn)
            except (EOFError, OSError):
                return None
        if proc.sentinel in ready:
            try:
                if conn.poll(0):
                    return _recv_reply(conn)
            except (EOFError, OSError):
                pass
            return None
        if board is not None:
            failed = board.failures(seq)
            failed.pop(board.rank, None)
            if failed:
                raise _remote_failure(_remote_message(seq, failed, None, landed_here=False), failed)
        if deadline is not None and time.monotonic() > deadline:
            raise CheckpointTimeoutError(
                f"async save #{seq}, phase 'write': the writer process (pid {proc.pid}) did not answer "
                f"within {TIMEOUT_ENV} + {_REPLY_GRACE_S:g} s", "write", ())


def _recv_reply(conn: Any) -> SaveReply:
    """Receive a reply that is ready, the garbage collector paused while it is unpickled.

    A 2000-tensor reply is ~20k objects: their allocation set off full collections of
    the training process's heap (0.13 s, in 2 of 3 saves at 2000 x 0.5 MiB, world 2) on
    the landing path.  Paused only for the unpickling, not while waiting for the reply.
    """
    with gc_paused():
        return conn.recv()


def _death_message(proc: Any, checkpoint_id: Optional[str], starting: bool = False, saving: bool = True) -> str:
    """What to tell the caller of a writer process that died: during a save (``saving``)
    or while ``start_writer`` waited for it; ``starting``: before it had served any
    request (``start_writer``'s, or that of the save that started it)."""
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    if not saving:
        text = f"the async checkpoint writer process (pid {proc.pid}) {how} while starting."
    else:
        where = f" into {checkpoint_id}" if checkpoint_id else ""
        text = (f"the async checkpoint writer process (pid {proc.pid}) {how} while saving{where}; "
                "this checkpoint did not land (no .metadata was committed). The next async_save starts "
                "a new writer process.")
    if starting and (code is None or code > 0):
        # Its own traceback went to stderr.  The common cause: spawn imports the training
        # script again in the writer, which then runs the script's top-level code.
        text += (" It died before serving any request; its error is on stderr. The writer is started with "
                 "multiprocessing's 'spawn', which imports the main script again in the new process: a "
                 "script that trains or saves at its top level must do so under "
                 "`if __name__ == \"__main__\":`.")
    return text


_persister: Optional[_Persister] = None
_persister_lock = threading.Lock()


def _get_persister() -> _Persister:
    global _persister
    with _persister_lock:
        if _persister is None:
            _persister = _Persister()
        return _persister


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Optional[CheckpointId] = None,
    storage_writer: Optional[StorageWriter] = None,
    planner: Optional[SavePlanner] = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    use_gloo: bool = False,
    callback: Optional[Callable[[], None]] = None,
    process_group: Any = None,
) -> AsyncSaveResponse:
    """Stage ``state_dict`` to host memory now; plan, coordinate and write in a background process.

    When this returns every tensor has been copied (device → reusable shared host
    buffers) and non-tensor leaves have been copied with :class:`DataCopier`: the caller
    may overwrite anything in ``state_dict``, which is not modified.  The persistent
    writer process then runs the same save pipeline as :func:`save`; the returned
    :class:`AsyncSaveResponse` resolves to the global :class:`Metadata` once the
    checkpoint has landed, after ``callback()`` ran (its exceptions are logged).  A call
    while an earlier save is in flight first waits for it.  Coordination: ``use_gloo=True``
    → a CPU gloo group of the writer processes (needs ``MASTER_ADDR``/``MASTER_PORT``, else
    ``AssertionError``; port ``MASTER_PORT + 1`` or ``$HP_DCP_ASYNC_GLOO_PORT``);
    ``use_gloo=False`` → ``LOCAL_PLAN_{rank}.pkl`` / ``STORAGE_DATA_{rank}.pkl`` files in
    the checkpoint directory (needs ``checkpoint_id``); ``use_collectives=False`` → none,
    ``{rank}.metadata`` each.  With collectives every rank must call (every rank of
    ``process_group`` when one is given: a sub-group saves as its group ranks).  A
    ``Stateful`` leaf (``state_dict()`` + ``load_state_dict()``) is saved as its state dict.

    Raises here: ``ValueError`` without a destination, ``AssertionError`` as above, and
    staging errors (e.g. :class:`UnsupportedPlacementError`).  Errors of the writer
    (with their original message), or :class:`AsyncSaveError` when it died, come through
    the future.
    """
    return _get_persister().submit(
        state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
        no_dist=no_dist, use_collectives=use_collectives, use_gloo=use_gloo, callback=callback,
        process_group=process_group,
    )


def start_writer(wait: bool = False, timeout: Optional[float] = None) -> None:
    """Start this process's async writer process now, in the background.

    Optional: the first :func:`async_save` starts it otherwise, and then that save's time
    to landed includes the writer's start (it imports torch: 1-2 s).  Call it early (at
    start-up, before the first training step) to take that off the first checkpoint.  A
    no-op while a writer is running; :func:`shutdown_writer` stops it.  Returns at once,
    or with ``wait=True`` once the writer is ready to save (at most ``timeout`` seconds:
    else :class:`CheckpointTimeoutError`; :class:`AsyncSaveError` if it died starting).
    """
    _get_persister().prestart(wait, timeout)


def staging_buffer_ptrs() -> dict[Any, int]:
    """Host address of the staging slot of every known piece (``(fqn, offsets, sizes, dtype)``)."""
    return _get_persister().arena.buffer_ptrs()


def shutdown_writer() -> None:
    """Wait for the save in flight, stop the writer process and free the staging memory.

    The next :func:`async_save` starts a new writer.  A no-op when none was started.
    """
    p = _persister
    if p is not None:
        p.shutdown()


def writer_pid() -> Optional[int]:
    """Pid of the live writer process, or ``None``."""
    p = _persister
    return p.proc.pid if p is not None and p.proc is not None and p.proc.is_alive() else None
