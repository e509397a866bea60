"""``async_save``: stage now in the training process, persist in the writer process, and
learn every rank's outcome: an :class:`Outcomes` board in the job's store, keys under
``hp-dcp/async/<session>/<group>/<seq>/``: ``fail`` (a counter), ``fail/<rank>`` (the
error), ``ok/<rank>``, ``retired/<rank>``.

Exports :func:`async_save`, :class:`AsyncSaveResponse`, :func:`start_writer`,
:func:`shutdown_writer`; and :func:`choose_mode`, :func:`gloo_init_method`,
:func:`mailbox_session`, :func:`outcome_board`, :class:`Outcomes`, :func:`others_failed`,
:func:`remote_failure` (how one save's writer processes coordinate)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing.util as mp_util
import os
import threading
import time
import traceback
import uuid
import warnings
from typing import Any, Callable, Optional, Union

from hyper_parallel_dcp.core import Metadata, SavePlanner, StandardSavePlanner, StorageWriter, settings
from hyper_parallel_dcp.core.backends import storage_writer_for, url_scheme
from hyper_parallel_dcp.core.collectives import default_store
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError, describe_failures, format_ranks
from hyper_parallel_dcp.core.gc_pause import gc_paused
from hyper_parallel_dcp.core.pipeline import process_rank
from hyper_parallel_dcp.core.settings import phase
from hyper_parallel_dcp.core.stateful import expand_stateful

from .arena import StagingArena, StagingStats
from .errors import AsyncSaveError, AsyncSaveFailureWarning
from .writer import POLL_S, Mode, SaveReply, SaveRequest, WriterProcess, clean_planner, parent_cache_entry

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning", "AsyncSaveResponse", "Outcomes", "async_save", "choose_mode",
           "gloo_init_method", "mailbox_session", "others_failed", "outcome_board", "remote_failure",
           "shutdown_writer", "start_writer"]

logger = logging.getLogger(__name__)

CheckpointId = Union[str, os.PathLike]

#: Seconds a rank whose writer failed looks for a peer's failure that caused it.
_ECHO_WAIT_S = 1.0


#: First pause of :meth:`Outcomes.wait_all`, doubling up to :data:`POLL_S` (the ranks'
#: writers finish within milliseconds of each other).
_FIRST_PAUSE_S = 0.002
_SESSION_KEY = "hp_dcp_async_mailbox_session"


def gloo_init_method() -> str:
    """The init method of the writers' gloo group: ``MASTER_ADDR``, ``MASTER_PORT + 1`` (or
    ``HP_DCP_ASYNC_GLOO_PORT``).  Raises ``AssertionError`` (documented; explicit, so that
    ``python -O`` keeps it) without them, ``SettingError`` for a bad port."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        raise AssertionError(
            "async_save(use_gloo=True), or on several ranks to a URL such as s3://, builds a CPU gloo group in the "
            "writer processes and needs the "
            "MASTER_ADDR and MASTER_PORT environment variables (the writers use MASTER_PORT + 1, or "
            f"{settings.ASYNC_GLOO_PORT.name})"
        )
    gloo_port = settings.ASYNC_GLOO_PORT.get()
    if not gloo_port:
        try:
            gloo_port = int(port) + 1
        except ValueError:
            raise settings.SettingError(f"MASTER_PORT={port!r} is not a port number") from None
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"tcp://{host}:{gloo_port}"


def choose_mode(*, no_dist: bool, world_size: int, use_collectives: bool, use_gloo: bool,
                target: Any) -> tuple[Mode, Optional[str]]:
    """The :class:`Mode` of a save and, for ``FILES``, its mailbox directory ``target``; a
    URL (``s3://``) gets ``GLOO``.  ``ValueError`` for ``FILES`` without a ``target``."""
    if no_dist or world_size == 1:
        return Mode.LOCAL, None
    if not use_collectives:
        return Mode.NONE, None
    if use_gloo or (target is not None and url_scheme(target) != "file"):
        return Mode.GLOO, None
    if target is None:
        raise ValueError("async_save(use_gloo=False) exchanges plans through the checkpoint directory and needs "
                         "checkpoint_id")
    return Mode.FILES, str(target)


def mailbox_session() -> str:
    """A token equal on all ranks and new for each job (and restart): the first proposed
    to the job's store (``compare_set``), else the launcher's run id."""
    token = ""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            key = f"{_SESSION_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            stored = default_store().compare_set(key, "", uuid.uuid4().hex[:12])
            token = stored.decode() if isinstance(stored, bytes) else str(stored)
    except Exception as exc:  # noqa: BLE001 - fall back to the launcher's run id
        logger.debug("async_save: no store for the mailbox session token: %s", exc)
    return token or os.environ.get("TORCHELASTIC_RUN_ID", "") or "job"


def outcome_board(session: str, rank: int, world_size: int, process_group: Any = None) -> Optional[Outcomes]:
    """The outcome board of a save of ``process_group`` (``None`` without a job store); each
    sub-group saving at once (pipeline stages) gets its own."""
    try:
        import torch.distributed as dist

        store = default_store()
        group = "world" if process_group is None else ",".join(map(str, dist.get_process_group_ranks(process_group)))
    except Exception as exc:  # noqa: BLE001 - no process group: no cross-rank outcomes
        logger.debug("async_save: no job store for the outcome board: %s", exc)
        return None
    return Outcomes(store, f"{session}/{group}", rank, world_size)


class Outcomes:
    """The per-save outcome board of one rank (``store`` is the training job's store)."""

    def __init__(self, store: Any, session: str, rank: int, world_size: int):
        self.store = store
        self.session = session
        self.rank = rank
        self.world_size = world_size

    def _key(self, seq: int, *parts: object) -> str:
        return "/".join(["hp-dcp/async", self.session, str(seq), *map(str, parts)])

    def publish_ok(self, seq: int) -> None:
        self.store.set(self._key(seq, "ok", self.rank), b"1")

    def publish_failure(self, seq: int, text: str) -> None:
        """Publish this rank's failure of save ``seq``; a store that is gone is logged."""
        try:
            self.store.set(self._key(seq, "fail", self.rank), text.encode(errors="replace")[:4000])
            self.store.add(self._key(seq, "fail"), 1)
        except Exception as exc:  # noqa: BLE001 - the store itself may be gone (job ending)
            logger.warning("async_save: cannot publish the failure of save #%d: %s", seq, exc)

    def publish_retired(self, seq: int) -> None:
        """Publish that this rank's writer of save ``seq`` is gone."""
        try:
            self.store.set(self._key(seq, "retired", self.rank), b"1")
        except Exception as exc:  # noqa: BLE001
            logger.warning("async_save: cannot publish the retirement of save #%d's writer: %s", seq, exc)

    def _present(self, seq: int, what: str) -> list[int]:
        return [r for r in range(self.world_size) if self.store.check([self._key(seq, what, r)])]

    def failures(self, seq: int) -> dict[int, str]:
        """Ranks whose save ``seq`` failed, with their error text (one store call if none)."""
        if self.store.add(self._key(seq, "fail"), 0) == 0:
            return {}
        return {r: self.store.get(self._key(seq, "fail", r)).decode(errors="replace")
                for r in self._present(seq, "fail")}

    def wait_all(self, seq: int, what: str, deadline: float, phase: str) -> dict[int, str]:
        """Wait until every rank published ``what`` for ``seq``, or one failed (returned); past
        ``deadline`` :class:`CheckpointTimeoutError` names ``phase`` and the missing ranks."""
        pause = _FIRST_PAUSE_S
        while True:
            failed = self.failures(seq)
            if failed and what == "ok":
                return failed
            missing = [r for r in range(self.world_size) if not self.store.check([self._key(seq, what, r)])]
            if not missing:
                return failed
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(
                    f"async save #{seq}, phase '{phase}': rank(s) [{format_ranks(missing)}] did not report within the "
                    f"deadline (waiting on rank {self.rank}); their training process died or hangs",
                    phase, tuple(missing),
                )
            time.sleep(pause)
            pause = min(POLL_S, pause * 2)


def others_failed(board: Outcomes, seq: int, until: Optional[float] = None) -> dict[int, str]:
    """The failures of save ``seq`` on other ranks, looking until ``until`` (monotonic) for one."""
    while True:
        failed = board.failures(seq)
        failed.pop(board.rank, None)
        if failed or until is None or time.monotonic() > until:
            return failed
        time.sleep(POLL_S)


def remote_failure(seq: int, failed: dict[int, str], checkpoint_id: Optional[str], landed_here: bool) -> AsyncSaveError:
    """The error of a rank whose own part landed (or was stopped) while save ``seq`` failed
    on the ranks of ``failed`` (their error texts)."""
    where = f" into {checkpoint_id}" if checkpoint_id else ""
    here = ("this rank's part had landed, but the checkpoint is not trusted" if landed_here else
            "this rank's writer was stopped")
    exc = AsyncSaveError(f"async save #{seq}{where} failed on rank(s) [{format_ranks(failed)}]; {here}. The next "
                         f"async_save starts new writer processes on every rank.\n{describe_failures(failed)}")
    exc.failed_ranks = tuple(sorted(failed))
    return exc


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
    """Handle of one async save: ``persist_completion`` (a ``Future[Metadata]``, resolved
    once landed and ``callback`` ran, or failed), ``staging``, ``cache_hit``, ``writer_pid``."""

    def __init__(self, checkpoint_id: Optional[str], staging: StagingStats, writer_pid: int):
        self._future = _Future()
        self._future.set_running_or_notify_cancel()  # a landing save cannot be cancelled
        self.persist_completion: concurrent.futures.Future[Metadata] = self._future
        self.checkpoint_id = checkpoint_id
        self.staging = staging
        self.writer_pid = writer_pid
        self.cache_hit: Optional[bool] = None
        self._thread: Optional[threading.Thread] = None

    def get_result(self, timeout: Optional[float] = None) -> Metadata:
        """The global metadata once landed; raises the writer's error or ``TimeoutError``."""
        return self.persist_completion.result(timeout)

    def done(self) -> bool:
        return self.persist_completion.done()

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else "landed" if self._future.peek_exception() is None else "failed"
        return f"AsyncSaveResponse({self.checkpoint_id!r}, {state})"


class _Persister:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arena = StagingArena()
        self.writer: Optional[WriterProcess] = None
        self.inflight: Optional[AsyncSaveResponse] = None
        self.last: Optional[AsyncSaveResponse] = None
        self.seq = 0
        #: the last coordinated save that failed: the next waits until all its writers are gone
        self.failed_seq: Optional[int] = None
        self.session: Optional[str] = None
        self._exit_hook: Any = None

    def _session(self) -> str:
        self.session = self.session or mailbox_session()
        return self.session

    def _live_writer(self) -> WriterProcess:
        """The writer process, started unless one is alive."""
        if self.writer is not None and self.writer.alive():
            return self.writer
        if self.writer is not None:
            self.writer.close()
        self.writer = WriterProcess()
        if self._exit_hook is None:
            # runs in multiprocessing's exit handler before it joins (forever) non-daemon children
            self._exit_hook = mp_util.Finalize(None, self.shutdown, exitpriority=100)
        return self.writer

    def _wait_inflight(self) -> None:
        response, self.inflight = self.inflight, None
        thread = response._thread if response is not None else None
        if thread is threading.current_thread():
            self.inflight = response
            raise RuntimeError("async_save cannot be called from the callback of the save in flight")
        if thread is not None:
            thread.join()

    def _surface_dropped(self) -> None:
        """Warn about the previous save's failure if nobody looked at its response."""
        last, self.last = self.last, None
        exc = last._future.peek_exception() if last is not None else None
        if last is not None and exc is not None and not last._future.observed:
            last._future.observed = True
            warnings.warn(AsyncSaveFailureWarning(
                f"the previous async_save{' into ' + last.checkpoint_id if last.checkpoint_id else ''} failed and "
                f"its response was never checked: {type(exc).__name__}: {exc}"), stacklevel=4)

    def prestart(self, wait: bool = False, timeout: Optional[float] = None) -> None:
        """Start the writer process now unless one is running (see :func:`start_writer`)."""
        with self._lock:
            writer = self._live_writer()
            if wait and writer.fresh:
                writer.ping(timeout)

    def shutdown(self) -> None:
        """Wait for the save in flight, then stop the writer process and free the staging memory."""
        with self._lock:
            with contextlib.suppress(RuntimeError):
                self._wait_inflight()
            if self.writer is not None:
                self.writer.stop(settings.ASYNC_SHUTDOWN_TIMEOUT.get())
                self.writer = None
            self.arena.clear()

    def _retire(self, writer: Optional[WriterProcess], seq: int, board: Optional[Outcomes]) -> None:
        """Stop this save's writer (it may wait for a dead peer, or miss a request) and say so."""
        if writer is not None:
            writer.kill()
        if board is not None:
            board.publish_retired(seq)
            self.failed_seq = seq

    def submit(self, state_dict: dict[str, Any], *, checkpoint_id: Optional[CheckpointId],
               storage_writer: Optional[StorageWriter], planner: Optional[SavePlanner], no_dist: bool,
               use_collectives: bool, use_gloo: bool, callback: Optional[Callable[[], None]],
               process_group: Any = None) -> AsyncSaveResponse:
        with self._lock:
            self._wait_inflight()
            self._surface_dropped()
            # counted first, on every call: equal on every rank even when some fail here
            self.seq += 1
            seq = self.seq
            use_collectives = use_collectives and not no_dist
            rank, world_size = (0, 1) if no_dist else process_rank(process_group)
            board = None
            if use_collectives and world_size > 1:
                board = outcome_board(self._session(), rank, world_size, process_group)
            try:
                if board is not None and self.failed_seq is not None:
                    # every rank's writer of the failed save must be gone before new ones meet
                    board.wait_all(self.failed_seq, "retired", time.monotonic() + settings.ASYNC_TIMEOUT.get(),
                                   "resynchronise")
                    self.failed_seq = None
                # staging a new layout allocates thousands of objects: no full collections
                with gc_paused():
                    state_dict, _ = expand_stateful(state_dict)  # a Stateful leaf: its state_dict()
                    writer = storage_writer_for(checkpoint_id, storage_writer, caller="async_save")
                    mode, mailbox_dir = choose_mode(
                        no_dist=no_dist, world_size=world_size, use_collectives=use_collectives, use_gloo=use_gloo,
                        target=checkpoint_id if checkpoint_id is not None else getattr(writer, "path", None))
                    local = mode is Mode.LOCAL
                    # use_gloo asks for MASTER_ADDR/MASTER_PORT even where one process needs no group
                    gloo_init = gloo_init_method() if mode is Mode.GLOO or (use_gloo and use_collectives) else None
                    request = SaveRequest(
                        seq=seq, storage_writer=writer, planner=clean_planner(planner), mode=mode,
                        rank=0 if local else rank, world_size=1 if local else world_size, no_dist=no_dist,
                        use_collectives=use_collectives, gloo_init=gloo_init if mode is Mode.GLOO else None,
                        mailbox_dir=mailbox_dir, mailbox_tag=f"{self._session()}-{seq}" if mailbox_dir else "",
                        timeout_s=settings.ASYNC_TIMEOUT.get(), save_suffix=f"-a{seq}")
                    return self._stage_and_send(request, state_dict, checkpoint_id, planner, callback, board, rank)
            except BaseException as exc:
                if board is not None:
                    board.publish_failure(seq, f"{type(exc).__name__}: {exc}")
                    self._retire(self.writer, seq, board)
                raise

    def _stage_and_send(self, request: SaveRequest, state_dict: dict[str, Any],
                        checkpoint_id: Optional[CheckpointId], planner: Optional[SavePlanner],
                        callback: Optional[Callable[[], None]], board: Optional[Outcomes],
                        rank: int) -> AsyncSaveResponse:
        writer = self.writer
        if writer is not None and writer.failed_starting():
            # start_writer()'s writer died of its own error, which a new one would repeat
            self.writer = None
            writer.close()
            raise AsyncSaveError(writer.death_message(None, starting=True, saving=False)
                                 + f" async_save into {checkpoint_id or 'the storage writer'} was not started.")
        writer = self._live_writer()  # started first: it imports torch while we stage
        started, writer.fresh = writer.fresh, False
        with phase("build_staged_state_dict", rank):
            request.staged, stats = self.arena.stage(state_dict)
        request.cache = parent_cache_entry(planner, request.staged.leaves.keys(), request.rank, request.world_size,
                                           request.use_collectives)
        response = AsyncSaveResponse(None if checkpoint_id is None else str(checkpoint_id), stats, writer.pid)
        response._thread = threading.Thread(target=self._join, name=f"hp-dcp-async-join-{request.seq}",
                                            args=(response, writer, request, planner, callback, board, started),
                                            daemon=False)
        response._thread.start()
        self.inflight = self.last = response
        return response

    def _join(self, response: AsyncSaveResponse, writer: WriterProcess, request: SaveRequest,
              planner: Optional[SavePlanner], callback: Optional[Callable[[], None]], board: Optional[Outcomes],
              started: bool) -> None:
        """The save's second half (joining thread); ``started``: the writer's first request."""
        seq = request.seq
        delivered = False
        try:
            # off the caller's path: filling a pending slab, and a send a starting writer blocks
            self.arena.complete()
            try:
                writer.held.send(writer.conn, request, self.arena.slabs)
            except (BrokenPipeError, ConnectionError, OSError):
                raise AsyncSaveError(writer.death_message(response.checkpoint_id, starting=started)) from None
            delivered = True
            reply = writer.await_reply(None if board is None else lambda: self._check_peers(board, seq), seq,
                                       request.timeout_s)
            if reply is None:
                raise AsyncSaveError(writer.death_message(response.checkpoint_id, starting=started))
            metadata = self._landed(reply, writer, board, response.checkpoint_id)
            response.cache_hit = reply.cache_hit
            if planner is not None and reply.cache_hit is not None:
                planner.cache_hit = reply.cache_hit
            if reply.cache is not None and not reply.cache_hit:
                StandardSavePlanner.plan_cache.install(reply.cache)
                writer.held.note_cache(StandardSavePlanner.plan_cache.export(reply.cache[0]))
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the future
            rank, world_size = process_rank()
            rank = board.rank if board is not None else rank
            logger.error("async_save #%d%s failed%s: %s: %s", seq,
                         f" into {response.checkpoint_id}" if response.checkpoint_id else "",
                         f" on rank {rank}" if board is not None or world_size > 1 else "", type(exc).__name__, exc)
            if board is not None and not (isinstance(exc, AsyncSaveError) and exc.failed_ranks):
                board.publish_failure(seq, "".join(traceback.format_exception_only(type(exc), exc)).strip())
            if board is not None or not delivered:
                # it may wait for a dead peer, or hold other slabs than we think
                self._retire(writer, seq, board)
            response._future.set_exception(exc)
            return
        if callback is not None:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the checkpoint has landed; a callback bug must not hide that
                logger.exception("async_save callback raised (the checkpoint %s has landed)", response.checkpoint_id)
        response._future.set_result(metadata)

    @staticmethod
    def _check_peers(board: Outcomes, seq: int) -> None:
        """Raise :class:`AsyncSaveError` once another rank on ``board`` failed save ``seq``."""
        failed = others_failed(board, seq)
        if failed:
            raise remote_failure(seq, failed, None, landed_here=False)

    @staticmethod
    def _landed(reply: SaveReply, writer: WriterProcess, board: Optional[Outcomes],
                checkpoint_id: Optional[str]) -> Metadata:
        """The metadata of a save landed on every rank; else raises the error of the rank that failed."""
        seq = reply.seq
        if reply.metadata is None:
            exc = reply.error if reply.error is not None else AsyncSaveError(reply.error_text or "no metadata")
            if reply.error is not None and hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"raised in the async writer process (pid {writer.pid}):\n{reply.error_text}")
            if board is not None:
                # our writer's error may only echo a peer's death: name that peer
                failed = others_failed(board, seq, time.monotonic() + _ECHO_WAIT_S)
                if failed:
                    raise remote_failure(seq, failed, checkpoint_id, landed_here=False) from exc
            raise exc
        if board is not None:
            board.publish_ok(seq)  # landed here; a success only once it landed on every rank
            failed = board.wait_all(seq, "ok", time.monotonic() + settings.ASYNC_TIMEOUT.get(), "finish")
            if failed:
                raise remote_failure(seq, failed, checkpoint_id, landed_here=True)
        return reply.metadata


_persister = _Persister()  # cheap: the writer process starts on first use


def _get_persister() -> _Persister:
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

    On return every leaf is copied (tensors into reusable shared host buffers, the rest
    with :class:`DataCopier`): the caller may overwrite ``state_dict``.  The response
    resolves to the global :class:`Metadata` once the checkpoint landed and ``callback()``
    ran (its exceptions are logged); a call while a save is in flight first waits for it.
    Coordination: ``use_gloo=True`` → a gloo group of the writers (``MASTER_ADDR`` and
    ``MASTER_PORT + 1`` or ``$HP_DCP_ASYNC_GLOO_PORT``, else ``AssertionError``);
    ``use_gloo=False`` → ``LOCAL_PLAN_{rank}.pkl`` / ``STORAGE_DATA_{rank}.pkl`` files in
    the checkpoint directory (a URL such as ``s3://`` uses the gloo group);
    ``use_collectives=False`` → ``{rank}.metadata`` each.  With collectives every rank (of
    ``process_group``) must call.  A ``Stateful`` leaf is saved as its state dict.

    Raises ``ValueError`` without a destination, ``AssertionError`` as above and staging
    errors here; the writer's errors, or :class:`AsyncSaveError` when it died, come
    through the future."""
    return _persister.submit(
        state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
        no_dist=no_dist, use_collectives=use_collectives, use_gloo=use_gloo, callback=callback,
        process_group=process_group,
    )


def start_writer(wait: bool = False, timeout: Optional[float] = None) -> None:
    """Start this process's writer process now (else the first :func:`async_save` does); a
    no-op while one runs.  ``wait=True``: return once it is ready, within ``timeout`` s
    (else :class:`CheckpointTimeoutError`; :class:`AsyncSaveError` if it died starting)."""
    _persister.prestart(wait, timeout)


def shutdown_writer() -> None:
    """Wait for the save in flight, stop the writer process and free the staging memory."""
    _persister.shutdown()
