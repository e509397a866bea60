"""The persistent writer process: receives staged saves and runs the one save pipeline.

Started with the ``spawn`` method, so it inherits no CUDA/NCCL/HCCL state and never
touches an accelerator: it only maps the staging slabs (shared memory) of the training
process.  It runs :func:`hyper_parallel_dcp.core.pipeline.save_state_dict` unchanged, with
its own CPU gloo group, the file mailbox, or no coordination, and answers with the
metadata and the plan-cache entry.  It exits on ``None``, when the training process's
end of the pipe closes, or as soon as the training process is gone (:func:`watch_parent`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import pickle
import select
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.plan_cache import PlanCacheEntry
from hyper_parallel_dcp.core.planner import SavePlanner
from hyper_parallel_dcp.core.save_planning import StandardSavePlanner
from hyper_parallel_dcp.core.settings import DEFAULT_TIMEOUT_S
from hyper_parallel_dcp.core.storage import StorageWriter

from .staging import StagedStateDict, materialize

__all__ = ["PING", "CacheEntry", "SaveReply", "SaveRequest", "wait_for_parent_exit", "watch_parent", "writer_main"]

#: A request the writer answers with ``PING`` once it is ready (torch imported, serving).
PING = "ping"

logger = logging.getLogger(__name__)

#: Launcher variables that describe the training job's rendezvous, not the writers' own.
_LAUNCHER_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCH_DIST_INIT_BARRIER")

# (plan-cache key, (final plan, metadata, fingerprint) or None for "no entry")
CacheEntry = PlanCacheEntry


@dataclass
class SaveRequest:
    """One save for the writer process.  ``mode``: ``local`` (one process / no_dist),
    ``none`` (no coordination), ``gloo`` or ``files``."""

    seq: int
    staged: StagedStateDict
    new_slabs: dict[int, torch.Tensor]
    storage_writer: StorageWriter
    planner: Optional[SavePlanner]
    mode: str
    rank: int
    world_size: int
    no_dist: bool
    use_collectives: bool
    gloo_init: Optional[str] = None
    mailbox_dir: Optional[str] = None
    mailbox_tag: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: the training process's plan-cache entry for this save; its value is ``None`` with
    #: ``cache_held`` when this writer already holds it (a 2000-tensor plan + metadata is
    #: ~100 ms to pickle: it is sent once, not with every save)
    cache: Optional[CacheEntry] = None
    cache_held: bool = False
    #: appended to the cached plan's save_id: a writer restarted after a crash never
    #: reuses the staging directory name of an earlier save
    save_suffix: str = ""


@dataclass
class SaveReply:
    seq: int
    metadata: Optional[Metadata] = None
    cache: Optional[CacheEntry] = None
    cache_hit: Optional[bool] = None
    error: Optional[BaseException] = None
    error_text: str = ""


def clean_planner(planner: Optional[SavePlanner]) -> Optional[SavePlanner]:
    """A copy of ``planner`` without per-save state (which may reference a state dict's tensors)."""
    if planner is None or not isinstance(planner, StandardSavePlanner):
        return planner
    return planner.without_state()


def cache_key(planner: StandardSavePlanner, flat_keys: Any, rank: int, world_size: int,
              use_collectives: bool) -> Any:
    """The plan-cache key ``planner`` would use for a state dict with ``flat_keys``."""
    probe = planner.without_state()
    probe.set_up_planner(dict.fromkeys(flat_keys), is_coordinator=rank == 0, rank=rank,
                         world_size=world_size, use_collectives=use_collectives)
    return probe.cache_key()


_MADV_POPULATE_READ = 22  # Linux 5.14+


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _libc_madvise()


def populate_read(buffer: torch.Tensor) -> bool:
    """Map every page of a newly received slab into this process in one system call.

    Writing 128 MiB from a slab mapped page by page on first touch cost 0.085 s CPU
    in the writer, 0.045 s after one ``MADV_POPULATE_READ`` (median of 6 alternating
    runs).  False where the kernel or platform has no such call (the write then maps the
    pages as it goes).  Does not change the buffer.
    """
    if _madvise is None or buffer.numel() == 0:
        return False
    start = buffer.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the buffer only
    end = (start + buffer.numel()) // mmap.PAGESIZE * mmap.PAGESIZE
    return end > first and _madvise(first, end - first, _MADV_POPULATE_READ) == 0


class _Writer:
    def __init__(self) -> None:
        self.slabs: dict[int, torch.Tensor] = {}
        self.gloo_init: Optional[tuple[str, int, int]] = None
        #: the training process's plan-cache entries as this writer last received or sent them
        self.held: dict[Any, Any] = {}
        #: the last whole staged description of a reusable layout: a later save of that
        #: layout sends its object leaves only
        self.staged: Optional[StagedStateDict] = None

    def _install_cache(self, req: SaveRequest) -> None:
        assert req.cache is not None
        key, value = req.cache
        if req.cache_held:
            value = self.held.get(key)  # missing: this save plans afresh (on every rank)
        elif value is not None:
            self.held[key] = value
        else:
            self.held.pop(key, None)
        if value is not None:
            plan, metadata, fingerprint = value
            value = (replace(plan, save_id=f"{plan.save_id}{req.save_suffix}"), metadata, fingerprint)
        StandardSavePlanner.plan_cache.install((key, value))

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
        from hyper_parallel_dcp.core.pipeline import save_state_dict

        from .mailbox import FileMailbox, RankIdentity

        # first: what this writer holds must follow every request it received, as the
        # training process assumes (a failing save does not end the writer)
        staged = req.staged.with_tensors_of(self.staged)
        if staged.layout_id is not None:
            self.staged = staged
        for buffer in req.new_slabs.values():
            populate_read(buffer)
        self.slabs.update(req.new_slabs)
        for slab_id in [i for i in self.slabs if i not in staged.slab_ids]:
            del self.slabs[slab_id]
        state_dict = materialize(staged, self.slabs)
        if req.cache is not None:
            self._install_cache(req)
        planner = req.planner if req.planner is not None else StandardSavePlanner()
        kwargs: dict[str, Any] = {"no_dist": req.no_dist, "use_collectives": req.use_collectives}
        mailbox = None
        if req.mode == "none":
            kwargs["dist_wrapper"] = RankIdentity(req.rank, req.world_size)
        elif req.mode == "gloo":
            assert req.gloo_init is not None
            self._ensure_gloo(req.gloo_init, req.rank, req.world_size, req.timeout_s)
        elif req.mode == "files":
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
            # A hit's entry is the one the training process sent: not sent back (2000
            # tensors: 0.75 MB more to pickle and unpickle on the landing path of every save).
            if planner.caching and not planner.cache_hit:
                reply.cache = planner.plan_cache.export(planner.cache_key())
                if reply.cache[1] is not None:
                    self.held[reply.cache[0]] = reply.cache[1]  # what the training process installs
        return reply


def _error_reply(seq: int, exc: BaseException) -> SaveReply:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))  # the original class travels only if it round-trips
        portable: Optional[BaseException] = exc
    except Exception:  # noqa: BLE001
        portable = None
    return SaveReply(seq, error=portable, error_text=f"{type(exc).__qualname__}: {exc}\n\n{text}")


#: Seconds between two looks at the parent where no pidfd can be polled (and the longest a
#: pidfd wait lasts before the parent pid is looked at again).
PARENT_POLL_S = 0.25


def wait_for_parent_exit(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Return once the process ``parent_pid`` (this process's parent) is gone.

    Linux: waits on a pidfd of the parent, woken the moment it exits.  Elsewhere, or where
    ``pidfd_open`` is refused: looks every ``poll_s`` seconds whether this process was
    re-parented (``getppid()`` changed), which is how POSIX shows a dead parent.  Returns at
    once if the parent is already gone.  (A pipe that closes with the parent is not enough:
    a process the trainer forks afterwards, e.g. a DataLoader worker, inherits its end.
    ``PR_SET_PDEATHSIG`` fires when the *thread* that started the writer exits.)
    """
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(parent_pid)
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


def watch_parent(parent_pid: int, in_flight: _InFlight,
                 exit_now: Callable[[int], None] = os._exit) -> threading.Thread:
    """Start a daemon thread that ends this process soon after ``parent_pid`` is gone.

    An orphaned writer abandons the save it runs: it exits at once, as a crash would, and
    the commit protocol (the coordinator commits last, after every rank's write results
    arrived; ``.metadata`` and the directory swap are atomic) never shows a half-written
    checkpoint.  Finishing the save instead could commit it while a restarted job already
    saves or loads in that directory, and a writer of another rank may wait for one of
    ours that died.  Before this, an orphan waited in a collective for up to
    ``HP_DCP_ASYNC_TIMEOUT`` (1800 s).  The thread needs the GIL only once, after the
    parent is gone; gloo waits and file writes release it.
    """

    def run() -> None:
        wait_for_parent_exit(parent_pid)
        seq = in_flight.seq
        what = f"abandons save #{seq} (not committed)" if seq is not None else "was idle"
        try:
            os.write(2, f"hyper_parallel_dcp async writer {os.getpid()}: the training process {parent_pid} "
                        f"is gone; the writer {what} and exits\n".encode())
        except OSError:
            pass
        exit_now(1 if seq is not None else 0)

    thread = threading.Thread(target=run, name="hp-dcp-parent-watch", daemon=True)
    thread.start()
    return thread


def _leave(parent_pid: Optional[int]) -> None:
    """Return from the writer's loop; with the training process gone, exit right away.

    An orphan skips the interpreter's shutdown (tearing down torch took 1-3 s on a loaded
    host, measured under torchrun): nothing is left to flush, and a replaced checkpoint
    still being deleted in the background is removed by the next save instead.
    """
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


def writer_main(conn: Any, parent_pid: Optional[int] = None) -> None:
    """Entry point of the writer process: serve :class:`SaveRequest` until told to stop.

    ``parent_pid``: the training process; the writer exits soon after it is gone, even
    in the middle of a save (see :func:`watch_parent`).
    """
    import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor reductions

    # Under torchrun the training process's environment says "join the agent's store"
    # (TORCHELASTIC_USE_AGENT_STORE=True): then no writer would host the store of the
    # writers' own gloo group on MASTER_PORT + 1 and every use_gloo save would time out.
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
        in_flight.seq = getattr(req, "seq", -1)
        try:
            reply = writer.save(req)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the future
            reply = _error_reply(getattr(req, "seq", -1), exc)
            reply.metadata = None
        finally:
            in_flight.seq = None
        if reply.error is None and reply.error_text == "" and reply.metadata is None:
            reply.error_text = "writer returned no metadata"
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return _leave(parent_pid)
        finally:
            req = None  # drop the staged state dict's views before waiting again
