"""The writer process, both ends: what the training process and its writer send each other
(:class:`SaveRequest`, :class:`SaveReply`; what the writer holds already is left out, see
:class:`Holdings`), the training process's handle of it (:class:`WriterProcess`: spawn,
readiness, send, await the reply, stop, what to say when it died), and the ``spawn``ed
process itself (:func:`writer_main`: maps the slabs and runs ``save_state_dict`` on each
staged save; :func:`watch_parent`, :func:`wait_for_parent_exit`)."""

from __future__ import annotations

import contextlib
import enum
import logging
import multiprocessing.connection as mp_connection
import os
import pickle
import select
import signal
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from hyper_parallel_dcp.core import Metadata, SavePlanner, StandardSavePlanner, StorageWriter, save_state_dict, settings
from hyper_parallel_dcp.core.collectives import DistWrapper
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError
from hyper_parallel_dcp.core.gc_pause import gc_paused
from hyper_parallel_dcp.core.plan_cache import PlanCacheEntry
from hyper_parallel_dcp.core.settings import DEFAULT_TIMEOUT_S

from .arena import StagedStateDict, materialize, populate_slab
from .errors import AsyncSaveError
from .mailbox import FileMailbox

__all__ = ["PING", "POLL_S", "Holdings", "Mode", "SaveReply", "SaveRequest", "WriterProcess", "clean_planner",
           "parent_cache_entry", "recv_reply", "wait_for_parent_exit", "watch_parent", "writer_main"]

logger = logging.getLogger(__name__)

#: A request the writer answers with ``PING`` once it is ready (torch imported, serving).
PING = "ping"
#: Seconds between two looks at the store while a coordinated save is in flight.
POLL_S = 0.05


class Mode(enum.Enum):
    """How the writer processes of one save coordinate."""

    LOCAL = "local"  # one process (world size 1 or no_dist): nothing to coordinate
    NONE = "none"  # several ranks, use_collectives=False: {rank}.metadata each
    GLOO = "gloo"  # the writers' own CPU gloo group
    FILES = "files"  # the file mailbox in the checkpoint directory


@dataclass
class SaveRequest:
    """One save for the writer process; ``cache``: the plan-cache entry; ``save_suffix`` goes
    after a cached plan's save_id."""

    seq: int
    storage_writer: StorageWriter
    planner: Optional[SavePlanner]
    mode: Mode
    rank: int
    world_size: int
    no_dist: bool
    use_collectives: bool
    staged: StagedStateDict = field(default_factory=StagedStateDict)
    gloo_init: Optional[str] = None
    mailbox_dir: Optional[str] = None
    mailbox_tag: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    cache: Optional[PlanCacheEntry] = None
    save_suffix: str = ""
    # set by Holdings.send: the slabs the writer lacks; the entry's value left out as held
    new_slabs: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_held: bool = False


@dataclass
class SaveReply:
    """The writer's answer to request ``seq``: the metadata, or the error (the exception
    itself when it pickles, and its text with the writer's traceback)."""

    seq: int
    metadata: Optional[Metadata] = None
    cache: Optional[PlanCacheEntry] = None  # a fresh plan's entry; None on a cache hit
    cache_hit: Optional[bool] = None
    error: Optional[BaseException] = None
    error_text: str = ""


class Holdings:
    """What one writer process holds of earlier requests (slabs, plan-cache entries), kept
    alike on both ends: the training process's copy leaves it out of a request
    (:meth:`send`), the writer's puts it back (:meth:`receive`)."""

    def __init__(self) -> None:
        self.slabs: dict[int, torch.Tensor] = {}
        self.cache: dict[Any, Any] = {}  # plan-cache key -> the entry object of this process's cache

    def send(self, conn: Any, request: SaveRequest, slabs: dict[int, torch.Tensor]) -> None:
        """Send ``request`` with the ``slabs`` the writer lacks, without the plan-cache entry
        it holds, then note what it holds (nothing when ``conn.send`` raises)."""
        cache, held = request.cache, False
        if cache is not None and cache[1] is not None and self.cache.get(cache[0]) is cache[1]:
            cache, held = (cache[0], None), True
        conn.send(replace(request, new_slabs={i: t for i, t in slabs.items() if i not in self.slabs}, cache=cache,
                          cache_held=held))
        self.slabs = {i: slabs[i] for i in request.staged.slab_ids}
        self.note_cache(request.cache)

    def receive(self, req: SaveRequest) -> tuple[dict[int, torch.Tensor], Optional[PlanCacheEntry]]:
        """The live slabs and plan-cache entry of ``req``; what this writer holds is updated
        first (its training process assumes so, whatever the save does next)."""
        self.slabs.update(req.new_slabs)
        for slab_id in [i for i in self.slabs if i not in req.staged.slab_ids]:
            del self.slabs[slab_id]
        if req.cache is None:
            return self.slabs, None
        key, value = req.cache
        if req.cache_held:
            value = self.cache.get(key)  # missing: this save plans afresh (on every rank)
        elif value is not None:
            self.cache[key] = value
        else:
            self.cache.pop(key, None)
        return self.slabs, (key, value)

    def note_cache(self, entry: Optional[PlanCacheEntry]) -> None:
        """The writer holds ``entry`` (sent to it, or sent back by it and installed by the
        training process)."""
        if entry is not None and entry[1] is not None:
            self.cache[entry[0]] = entry[1]


def clean_planner(planner: Optional[SavePlanner]) -> Optional[SavePlanner]:
    """A copy of ``planner`` without per-save state (which may reference a state dict's tensors)."""
    return planner.without_state() if isinstance(planner, StandardSavePlanner) else planner


def parent_cache_entry(planner: Optional[SavePlanner], flat_keys: Iterable[str], rank: int, world_size: int,
                       use_collectives: bool) -> Optional[PlanCacheEntry]:
    """This process's plan-cache entry for a save of ``flat_keys``, to mirror into the
    writer; ``None`` when the save uses no plan cache."""
    if not use_collectives:
        return None
    probe = planner if planner is not None else StandardSavePlanner()
    if not isinstance(probe, StandardSavePlanner) or not probe.enable_plan_caching:
        return None
    probe = probe.without_state()
    probe.set_up_planner(dict.fromkeys(flat_keys), is_coordinator=rank == 0, rank=rank, world_size=world_size,
                         use_collectives=use_collectives)
    return probe.plan_cache.export(probe.cache_key())


#: How much lower (``nice``) the writer process runs than the training process.
_WRITER_NICE = 10
#: Seconds the training process waits for its writer beyond the writer's own timeout.
_REPLY_GRACE_S = 60.0


class WriterProcess:
    """A started writer process (``spawn``, not a daemon), its pipe and :class:`Holdings`;
    ``fresh``: it has had no request yet (it may still be importing torch)."""

    def __init__(self) -> None:
        import torch.multiprocessing as torch_mp  # registers the shared-memory tensor reductions

        ctx = torch_mp.get_context("spawn")  # never fork: the child must not inherit CUDA/NCCL state
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=writer_main, args=(child_end, os.getpid()), name="hp-dcp-async-writer",
                                daemon=False)
        self.proc.start()
        child_end.close()
        assert self.proc.pid is not None  # started
        self.pid: int = self.proc.pid
        try:
            # lowered at once: its start (importing torch) overlaps the first save's staging
            os.setpriority(os.PRIO_PROCESS, self.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + _WRITER_NICE))
        except OSError as exc:  # already gone, or priorities are not ours to set
            logger.debug("async_save: cannot lower the writer's priority: %s", exc)
        self.held = Holdings()
        self.fresh = True

    def alive(self) -> bool:
        return self.proc.is_alive()

    def failed_starting(self) -> bool:
        """It exited of an error of its own before any request (its traceback is on stderr)."""
        return self.fresh and not self.proc.is_alive() and (self.proc.exitcode or 0) > 0

    def ping(self, timeout: Optional[float]) -> None:
        """Return once the writer answers a ping; :class:`AsyncSaveError` if it died,
        :class:`CheckpointTimeoutError` after ``timeout`` seconds."""
        ready: list[Any] = []
        try:
            self.conn.send(PING)
            ready = mp_connection.wait([self.conn, self.proc.sentinel], timeout)
            answer = self.conn.recv() if self.conn in ready else None
        except (EOFError, OSError):
            answer = None
        if answer != PING:
            if ready:  # its pipe closed or it exited: not a timeout, even before its exit status is there
                self.proc.join(timeout=5)
            if not self.proc.is_alive():
                raise AsyncSaveError(self.death_message(None, starting=True, saving=False))
            raise CheckpointTimeoutError(f"the async writer process (pid {self.pid}) was not ready within "
                                         f"{timeout} s", "start_writer", ())
        self.fresh = False

    def await_reply(self, check_peers: Optional[Callable[[], None]], seq: int, timeout_s: float) -> Optional[SaveReply]:
        """The writer's reply, or ``None`` if it died first; ``check_peers`` runs every
        :data:`POLL_S` s and raises once another rank failed; :class:`CheckpointTimeoutError`
        past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s + _REPLY_GRACE_S
        while True:
            ready = mp_connection.wait([self.conn, self.proc.sentinel], timeout=POLL_S if check_peers else 1.0)
            try:
                if self.conn in ready or (self.proc.sentinel in ready and self.conn.poll(0)):
                    return recv_reply(self.conn)
            except (EOFError, OSError):
                return None
            if self.proc.sentinel in ready:
                return None
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(
                    f"async save #{seq}, phase 'write': the writer process (pid {self.pid}) did not answer within "
                    f"{settings.ASYNC_TIMEOUT.name} + {_REPLY_GRACE_S:g} s", "write", ())

    def kill(self) -> None:
        """Stop it now (it may be stuck waiting for a dead peer)."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)

    def stop(self, timeout: float) -> None:
        """Tell it to stop and wait up to ``timeout`` seconds, then terminate it; close the pipe."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError):  # a broken pipe included
                self.conn.send(None)
            self.proc.join(timeout=timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=10)
        self.close()

    def close(self) -> None:
        """Drop the pipe (a writer still alive exits when it sees it closed)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        self.proc.join(timeout=0)

    def death_message(self, checkpoint_id: Optional[str], starting: bool, saving: bool = True) -> str:
        """What to tell the caller when the writer died during a save (``saving``) or while
        starting; ``starting``: before it had served any request."""
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        if not saving:
            text = f"the async checkpoint writer process (pid {self.pid}) {how} while starting."
        else:
            where = f" into {checkpoint_id}" if checkpoint_id else ""
            text = (f"the async checkpoint writer process (pid {self.pid}) {how} while saving{where}; this "
                    "checkpoint did not land (no .metadata was committed). The next async_save starts a new writer "
                    "process.")
        if starting and (code is None or code > 0):
            text += (" It died before serving any request; its error is on stderr. The writer is started with "
                     "multiprocessing's 'spawn', which imports the main script again in the new process: a "
                     "script that trains or saves at its top level must do so under "
                     "`if __name__ == \"__main__\":`.")
        return text


def recv_reply(conn: Any) -> SaveReply:
    """Receive a reply that is ready, the garbage collector paused while it is unpickled
    (a large reply's objects set off full collections of the training process's heap)."""
    with gc_paused():
        return conn.recv()


#: Launcher variables that describe the training job's rendezvous, not the writers' own.
_LAUNCHER_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCH_DIST_INIT_BARRIER")


class _Writer:
    def __init__(self) -> None:
        self.holdings = Holdings()
        self.gloo_init: Optional[tuple[str, int, int]] = None

    def _ensure_gloo(self, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        wanted = (init_method, rank, world_size)
        if self.gloo_init == wanted and dist.is_initialized():
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.gloo_init = wanted

    def save(self, req: SaveRequest) -> SaveReply:
        for buffer in req.new_slabs.values():
            populate_slab(buffer)
        slabs, cache = self.holdings.receive(req)
        state_dict = materialize(req.staged, slabs)
        if cache is not None:
            key, value = cache
            if value is not None:
                plan, metadata, fingerprint = value
                value = (replace(plan, save_id=f"{plan.save_id}{req.save_suffix}"), metadata, fingerprint)
            StandardSavePlanner.plan_cache.install((key, value))
        planner = req.planner if req.planner is not None else StandardSavePlanner()
        kwargs: dict[str, Any] = {"no_dist": req.no_dist, "use_collectives": req.use_collectives}
        mailbox = None
        if req.mode is Mode.NONE:
            # no exchange, but the training process's rank (else: rank 0 of 1)
            kwargs["dist_wrapper"] = DistWrapper(None, use_dist=False, rank=req.rank, world_size=req.world_size)
        elif req.mode is Mode.GLOO:
            assert req.gloo_init is not None
            self._ensure_gloo(req.gloo_init, req.rank, req.world_size, req.timeout_s)
        elif req.mode is Mode.FILES:
            assert req.mailbox_dir is not None
            mailbox = FileMailbox(req.mailbox_dir, req.rank, req.world_size, req.mailbox_tag, timeout=req.timeout_s)
            kwargs["dist_wrapper"] = mailbox
        try:
            metadata = save_state_dict(state_dict, req.storage_writer, planner, **kwargs)
        finally:
            if mailbox is not None:
                mailbox.finish()
        reply = SaveReply(req.seq, metadata)
        if isinstance(planner, StandardSavePlanner):
            reply.cache_hit = planner.cache_hit
            # a hit's entry is the one the training process sent: not sent back
            if planner.caching and not planner.cache_hit:
                reply.cache = planner.plan_cache.export(planner.cache_key())
                self.holdings.note_cache(reply.cache)
        return reply


def _error_reply(seq: int, exc: BaseException) -> SaveReply:
    """The reply for a failed save; the exception itself travels only if it pickles."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
        portable: Optional[BaseException] = exc
    except Exception:  # noqa: BLE001
        portable = None
    return SaveReply(seq, error=portable, error_text=f"{type(exc).__qualname__}: {exc}\n\n{text}")


#: Seconds between two looks at the parent (without a pidfd: how often it is polled).
PARENT_POLL_S = 0.25


def wait_for_parent_exit(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Return once the parent process ``parent_pid`` is gone (a pidfd, else a look every
    ``poll_s`` seconds whether this process was re-parented)."""
    try:
        pidfd = os.pidfd_open(parent_pid) if hasattr(os, "pidfd_open") else None
    except OSError:
        pidfd = None
    try:
        # getppid() after pidfd_open: the pidfd refers to our parent only if it was alive then
        while os.getppid() == parent_pid:
            if pidfd is None:
                time.sleep(poll_s)
            elif select.select([pidfd], [], [], poll_s)[0]:
                return
    finally:
        if pidfd is not None:
            os.close(pidfd)


class _InFlight:
    """Which save the writer is running (read by the parent watch)."""

    seq: Optional[int] = None


def watch_parent(parent_pid: int, in_flight: _InFlight) -> threading.Thread:
    """Start a daemon thread that ends this process soon after ``parent_pid`` is gone (an
    orphan abandons its save, as a crash would)."""

    def run() -> None:
        wait_for_parent_exit(parent_pid)
        seq = in_flight.seq
        what = (f"stops in the middle of save #{seq} (it commits only if this rank's write results had already "
                "reached the coordinator)") if seq is not None else "was idle"
        with contextlib.suppress(OSError):
            os.write(2, f"hyper_parallel_dcp async writer {os.getpid()}: the training process {parent_pid} "
                        f"is gone; the writer {what} and exits\n".encode())
        os._exit(1 if seq is not None else 0)

    thread = threading.Thread(target=run, name="hp-dcp-parent-watch", daemon=True)
    thread.start()
    return thread


def _leave(parent_pid: Optional[int]) -> None:
    """Return from the writer's loop; with the training process gone, exit at once."""
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


def writer_main(conn: Any, parent_pid: Optional[int] = None) -> None:
    """Entry point of the writer process: serve requests on ``conn`` until told to stop, or
    soon after the training process ``parent_pid`` is gone (see :func:`watch_parent`)."""
    import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor reductions

    # under torchrun no writer would host the writers' gloo store (every use_gloo save: timeout)
    for name in _LAUNCHER_ENV:
        os.environ.pop(name, None)
    torch.set_num_threads(1)  # the writer hashes and writes; it must not compete with training
    in_flight = _InFlight()
    if parent_pid is not None:
        watch_parent(parent_pid, in_flight)
    writer = _Writer()
    logger.debug("async writer process %d started", os.getpid())
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return _leave(parent_pid)  # the training process is gone, or dropped this writer
        if req is None:
            return
        if req == PING:
            try:
                conn.send(PING)
            except (BrokenPipeError, OSError):
                return _leave(parent_pid)
            continue
        in_flight.seq = req.seq
        try:
            reply = writer.save(req)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the future
            reply = _error_reply(req.seq, exc)
        finally:
            in_flight.seq = None
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return _leave(parent_pid)
        finally:
            req = None  # drop the staged state dict's views before waiting again
