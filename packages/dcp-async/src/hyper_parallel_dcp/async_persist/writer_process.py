"""One writer process as the training process sees it: start, readiness, requests and
replies, stop, and what to say when it died.  Exports :class:`WriterProcess`, :func:`recv_reply`."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mp_connection
import os
import signal
import time
from typing import Any, Optional

from hyper_parallel_dcp.core import settings
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError
from hyper_parallel_dcp.core.gc_pause import gc_paused

from .coordination import POLL_S, Outcomes, others_failed, remote_failure
from .errors import AsyncSaveError
from .protocol import PING, SaveReply, WriterMirror
from .writer import writer_main

__all__ = ["WriterProcess", "recv_reply"]

logger = logging.getLogger(__name__)

#: How much lower (``nice``) the writer process runs than the training process.
_WRITER_NICE = 10
#: Seconds the training process waits for its writer beyond the writer's own timeout.
_REPLY_GRACE_S = 60.0


class WriterProcess:
    """A started writer process (``spawn``, not a daemon), its pipe and :class:`WriterMirror`;
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
        self.mirror = WriterMirror()
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

    def await_reply(self, board: Optional[Outcomes], seq: int, timeout_s: float) -> Optional[SaveReply]:
        """The writer's reply, or ``None`` if it died first; :class:`AsyncSaveError` once another
        rank on ``board`` fails save ``seq``, :class:`CheckpointTimeoutError` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s + _REPLY_GRACE_S
        while True:
            ready = mp_connection.wait([self.conn, self.proc.sentinel], timeout=POLL_S if board is not None else 1.0)
            try:
                if self.conn in ready or (self.proc.sentinel in ready and self.conn.poll(0)):
                    return recv_reply(self.conn)
            except (EOFError, OSError):
                return None
            if self.proc.sentinel in ready:
                return None
            failed = others_failed(board, seq) if board is not None else {}
            if failed:
                raise remote_failure(seq, failed, None, landed_here=False)
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
