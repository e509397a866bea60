"""Every rank learns every rank's outcome of each async save, through the job's store.

The writer processes of a coordinated async save (``use_gloo=True`` or the file mailbox)
wait for each other; a writer that dies cannot tell its peers, which would wait until
their timeout.  Its training process can: it sees the writer's death at once (the
process sentinel) and publishes the failure in the training job's key-value store (the
default process group's store: torchrun's, or the test runner's file store).  The other
training processes poll that store while their own writer works (every
:data:`POLL_S` seconds), and on a failure anywhere they stop their own writer and fail
their response, naming the rank.  So the liveness signal between writers is their
parents, and a writer's death surfaces on every rank within a fraction of a second.

Keys, under ``hp-dcp/async/<session>/<seq>/`` (``seq`` counts ``async_save`` calls and is
equal on all ranks): ``fail`` (counter) and ``fail/<rank>`` (the error text),
``ok/<rank>``, and ``retired/<rank>`` (that rank's writer of this save is gone, so a new
set of writers may start).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from hyper_parallel_dcp.core.errors import CheckpointTimeoutError, format_ranks

__all__ = ["POLL_S", "Outcomes"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the store while a save is in flight.
POLL_S = 0.05
#: First pause of :meth:`Outcomes.wait_all` (doubling up to :data:`POLL_S`).
_FIRST_PAUSE_S = 0.002


class Outcomes:
    """The per-save outcome board of one rank (``store`` is the training job's store)."""

    def __init__(self, store: Any, session: str, rank: int, world_size: int):
        self.store = store
        self.session = session
        self.rank = rank
        self.world_size = world_size

    def _key(self, seq: int, *parts: object) -> str:
        return "/".join(["hp-dcp/async", self.session, str(seq), *map(str, parts)])

    # -- publishing ------------------------------------------------------------------
    def publish_ok(self, seq: int) -> None:
        self.store.set(self._key(seq, "ok", self.rank), b"1")

    def publish_failure(self, seq: int, text: str) -> None:
        try:
            self.store.set(self._key(seq, "fail", self.rank), text.encode(errors="replace")[:4000])
            self.store.add(self._key(seq, "fail"), 1)
        except Exception as exc:  # noqa: BLE001 - the store itself may be gone (job ending)
            logger.warning("async_save: cannot publish the failure of save #%d: %s", seq, exc)

    def publish_retired(self, seq: int) -> None:
        try:
            self.store.set(self._key(seq, "retired", self.rank), b"1")
        except Exception as exc:  # noqa: BLE001
            logger.warning("async_save: cannot publish the retirement of save #%d's writer: %s", seq, exc)

    # -- looking ---------------------------------------------------------------------
    def _present(self, seq: int, what: str) -> list[int]:
        return [r for r in range(self.world_size) if self.store.check([self._key(seq, what, r)])]

    def failures(self, seq: int) -> dict[int, str]:
        """Ranks whose save ``seq`` failed, with their error text (one store call if none)."""
        if self.store.add(self._key(seq, "fail"), 0) == 0:
            return {}
        out = {}
        for r in self._present(seq, "fail"):
            out[r] = self.store.get(self._key(seq, "fail", r)).decode(errors="replace")
        return out

    def wait_all(self, seq: int, what: str, deadline: float, phase: str,
                 stop: Optional[Callable[[], bool]] = None) -> dict[int, str]:
        """Until every rank published ``what`` (``ok``/``retired``) for ``seq``, or one failed.

        Returns the failures (empty when all published).  Raises
        :class:`CheckpointTimeoutError` naming ``phase`` and the ranks that did not publish
        once ``deadline`` (monotonic) passes.  ``stop()`` returning True ends the wait early
        (returns the failures seen so far).
        """
        pause = _FIRST_PAUSE_S
        while True:
            failed = self.failures(seq)
            if failed and what == "ok":
                return failed
            missing = [r for r in range(self.world_size) if r not in self._present(seq, what)]
            if not missing:
                return failed
            if stop is not None and stop():
                return failed
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(
                    f"async save #{seq}, phase '{phase}': rank(s) [{format_ranks(missing)}] did not report within the "
                    f"deadline (waiting on rank {self.rank}); their training process died or hangs",
                    phase, tuple(missing),
                )
            # The ranks' writers finish within milliseconds of each other: look again soon,
            # then back off (a flat 50 ms pause added ~25 ms to every save's time to landed).
            time.sleep(pause)
            pause = min(POLL_S, pause * 2)
