"""The ``spawn``ed writer process: maps the training process's slabs and runs ``save_state_dict``
on each staged save.  Exports :func:`writer_main`, :func:`watch_parent`, :func:`wait_for_parent_exit`."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any, Optional

from hyper_parallel_dcp.core import StandardSavePlanner, save_state_dict
from hyper_parallel_dcp.core.collectives import DistWrapper

from .mailbox import FileMailbox
from .protocol import PING, Mode, SaveReply, SaveRequest, WriterHoldings
from .staged import materialize, populate_slab

__all__ = ["wait_for_parent_exit", "watch_parent", "writer_main"]

logger = logging.getLogger(__name__)

#: Launcher variables that describe the training job's rendezvous, not the writers' own.
_LAUNCHER_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCH_DIST_INIT_BARRIER")


class _Writer:
    def __init__(self) -> None:
        self.holdings = WriterHoldings()
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
        what = f"abandons save #{seq} (not committed)" if seq is not None else "was idle"
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
