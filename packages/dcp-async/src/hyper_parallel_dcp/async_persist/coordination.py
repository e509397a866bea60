"""How one save's writer processes coordinate, and how every rank learns every rank's
outcome: an :class:`Outcomes` board in the job's store, keys under
``hp-dcp/async/<session>/<group>/<seq>/``: ``fail`` (a counter), ``fail/<rank>`` (the
error), ``ok/<rank>``, ``retired/<rank>``.  Exports :func:`choose_mode`,
:func:`gloo_init_method`, :func:`mailbox_session`, :func:`outcome_board`,
:class:`Outcomes`, :func:`others_failed`, :func:`remote_failure`, :data:`POLL_S`."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Optional

from hyper_parallel_dcp.core import settings
from hyper_parallel_dcp.core.backends import url_scheme
from hyper_parallel_dcp.core.errors import CheckpointTimeoutError, describe_failures, format_ranks

from ._torch_compat import default_store
from .errors import AsyncSaveError
from .protocol import Mode

__all__ = ["POLL_S", "Outcomes", "choose_mode", "gloo_init_method", "mailbox_session", "others_failed",
           "outcome_board", "remote_failure"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the store while a save is in flight.
POLL_S = 0.05
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
