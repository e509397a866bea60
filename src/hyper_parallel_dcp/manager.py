"""``CheckpointManager``: save every N steps into ``root/step_N``, keep the last K, resume from the
newest complete step.  A failure on any rank is raised on every rank, once; storage access goes
through :mod:`hyper_parallel_dcp.step_storage`.  Exports :class:`CheckpointManager`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import threading
import time
from contextlib import ExitStack
from typing import Any, Optional, Union

from hyper_parallel_dcp import api, async_persist
from hyper_parallel_dcp.core.backends import storage_writer_for, url_scheme
from hyper_parallel_dcp.core.collectives import DistWrapper
from hyper_parallel_dcp.core.errors import (
    CheckpointException,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    describe_failures,
)
from hyper_parallel_dcp.core.stateful import expand_stateful

from .local_tier import LocalTier
from .retention import best_steps, check_count, incremental_plan, referenced_steps, steps_to_delete
from .step_storage import step_storage_for

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)

def _check_metrics(metrics: Any) -> dict[str, Any]:
    """Plain JSON values (0-d tensors and numpy scalars become numbers); ``ValueError`` otherwise."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict of name -> number/str/bool, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be strings, got {key!r}")
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"metric {key!r} must be a number, string, bool or None, got {type(value).__name__}")
        out[key] = value
    return out


def _stored_metrics(info: Optional[dict[str, Any]]) -> Optional[dict[Any, Any]]:
    metrics = info.get("metrics") if info else None
    return metrics if isinstance(metrics, dict) else None


def _load_outcome(error: Optional[BaseException]) -> Optional[tuple[bool, str]]:
    """``None`` for a load that worked, else (whether the step is damaged, what failed)."""
    if error is None:
        return None
    damaged = isinstance(error, (CorruptCheckpointError, CheckpointFormatError, OSError)) and not isinstance(
        error, TimeoutError)
    # a CheckpointException is raised on every rank alike: say what failed where
    return damaged, error.describe() if isinstance(error, CheckpointException) else f"{type(error).__name__}: {error}"


class CheckpointManager:
    """Checkpoints of a training loop under ``root``, one ``root/step_N`` per saved step (SPEC §8).

    Retention keeps the newest ``keep_last`` complete steps (``None``: all), every multiple of
    ``keep_every``, the best ``keep_best`` by ``best_metric`` (``best_mode`` ``"min"``/``"max"``)
    and every step a kept incremental step points into.  ``async_save``: saves return once
    staged.  ``save_on_preemption``: a SIGTERM handler; the next :meth:`save` saves, waits and
    sets :attr:`preempted`.  ``local``: a :class:`LocalTier` beside this tier (SPEC §13).
    ``incremental``: saves reference the chunks shared with the newest earlier step (SPEC §14),
    every ``full_every``-th (``None``: only the first) in full.  :meth:`save`, :meth:`restore`,
    :meth:`wait` and :meth:`close` are collective.  Raises ``ValueError`` for a setting out of
    range, ``NotADirectoryError`` when ``root`` is a regular file.
    """

    def __init__(self, root: Union[str, os.PathLike], *, keep_last: Optional[int] = 3,
                 keep_every: Optional[int] = None, save_interval_steps: int = 1, async_save: bool = False,
                 keep_best: Optional[int] = None, best_metric: Optional[str] = None, best_mode: str = "min",
                 save_on_preemption: bool = False, local: Optional[LocalTier] = None,
                 incremental: bool = False, full_every: Optional[int] = None):
        self.keep_last = check_count("keep_last", keep_last, optional=True)
        self.keep_every = check_count("keep_every", keep_every, optional=True)
        self.save_interval_steps: int = check_count("save_interval_steps", save_interval_steps)
        self.keep_best = check_count("keep_best", keep_best, optional=True)
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if self.keep_best is not None and not (isinstance(best_metric, str) and best_metric):
            raise ValueError("keep_best needs best_metric, the name of a metric passed to save(metrics=...)")
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = bool(async_save)
        if local is not None and not isinstance(local, LocalTier):
            raise ValueError(f"local must be a LocalTier or None, got {type(local).__name__}")
        self.local = local
        self.incremental = bool(incremental)
        self.full_every = check_count("full_every", full_every, optional=True)
        self._references: dict[int, set[int]] = {}  # step -> steps it points into (incremental saves)
        if not isinstance(root, (str, os.PathLike)):
            raise ValueError(f"root must be a path or URL, got {type(root).__name__}")
        self.root = root
        self._steps = step_storage_for(root)
        self._steps.check_root()
        self._inflight: Optional[tuple[int, Any]] = None  # (step, AsyncSaveResponse)
        self._retention_due = False
        self._retained_once = False
        self._landed_step: Optional[int] = None  # the step whose retention is due
        self._closed = False
        self._info_cache: dict[int, Optional[dict[str, Any]]] = {}
        self._signal_received = False
        self.preempted = False
        self.save_on_preemption = bool(save_on_preemption)
        self._previous_handler: Any = None
        if self.save_on_preemption:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("save_on_preemption=True installs a SIGTERM handler and needs the main thread")
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.async_save:  # started now (it imports torch: 1-2 s), not in the first save's time
            async_persist.start_writer()

    def latest_step(self) -> Optional[int]:
        """The newest complete step under ``root`` (``None`` if there is none)."""
        return max(self.all_steps(), default=None)

    def all_steps(self) -> list[int]:
        """The complete steps under ``root``, ascending (an async save counts once landed; its
        retention runs at the next ``save``/``wait``/``close``)."""
        return [e.step for e in self._steps.list_steps() if e.complete]

    def metrics(self, step: int) -> Optional[dict[str, Any]]:
        """The metrics saved with ``step`` (rank 0's ``save(metrics=...)``), ``None`` if none were stored."""
        return _stored_metrics(self._steps.read_info(check_count("step", step, low=0)))

    def save(self, step: int, state_dict: dict[str, Any], *, force: bool = False,
             metrics: Optional[dict[str, Any]] = None) -> bool:
        """Save ``state_dict`` as ``step`` when ``step % save_interval_steps == 0`` or ``force``;
        True when this call saved (in either tier).  Collective, same ``step`` on every rank.

        ``async_save=True`` returns once staged, after the previous async save landed (its error
        is raised on every rank, once).  ``metrics`` (rank 0's JSON values) are stored for
        ``keep_best``.  Raises ``ValueError`` for a bad step or metrics, ``RuntimeError`` after
        :meth:`close`, and what ``save``/``async_save`` raise.
        """
        self._check_open()
        step = check_count("step", step, low=0)
        dw = DistWrapper(None, use_dist=True)
        preempting = self.save_on_preemption and any(
            dw.all_gather("checkpoint manager: preemption check", lambda: self._signal_received))
        local_due = self.local is not None and self.local.due(step)
        if self.local is not None and local_due:
            self.local.save(step, state_dict)  # first: it only stages here
        if not (force or preempting or step % self.save_interval_steps == 0):
            return local_due

        def write_info(_: list[None]) -> None:
            # checked here so that bad metrics fail every rank, and only on a saving step
            info = {"step": step, "saved_at": time.time(), "metrics": _check_metrics(metrics),
                    **self._incremental_plan(step)}
            self._info_cache.pop(step, None)
            self._steps.write_info(step, info)

        expanded: list[Any] = [state_dict]

        def expand() -> None:
            # a Stateful's failure is raised on every rank by this step (else: a deadlock)
            if not self.async_save:
                expanded[0], _ = expand_stateful(state_dict)

        self._land(dw, f"checkpoint manager: land the previous save, prepare step {step}", write_info, expand)
        location = self._steps.location(step)
        self._references.pop(step, None)
        base = self._incremental_plan(step)["incremental_from"]
        base_location = None if base is None else self._steps.location(base)
        started = time.perf_counter()
        if self.async_save:
            staging_error: Optional[BaseException] = None
            try:
                writer = storage_writer_for(location, None)  # async_save makes the same one without a base
                writer.configure_save(incremental_from=base_location)
                response = async_persist.async_save(state_dict, checkpoint_id=location, storage_writer=writer)
                self._inflight = (step, response)
                if dw.is_coordinator:
                    staged = response.staging.staged_bytes
                    logger.info("checkpoint manager: step %d staged for %s: %.1f MiB (%d bytes) (rank %d) in %.3f s; "
                                "it lands in the background", step, location, staged / 2**20, staged, dw.rank,
                                time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the step below
                staging_error = exc
            # a staging error on any rank is raised on all, else the previous retention runs
            try:
                self._retain(dw, protected=frozenset({step}), local_error=staging_error,
                             run=self._retention_due or not self._retained_once,
                             label=f"checkpoint manager: start the async save of step {step}, retention")
            except BaseException:
                self._settle_failed_step()
                raise
        else:
            metadata = api.save(expanded[0], checkpoint_id=location, incremental_from=base_location)
            if dw.is_coordinator:
                written = sum(metadata.files.values())
                logger.info("checkpoint manager: step %d landed in %s: %.1f MiB (%d bytes) in %.3f s", step, location,
                            written / 2**20, written, time.perf_counter() - started)
            self._retention_due = True
            self._landed_step = step
            self._retain(dw, protected=frozenset())
        if preempting:
            self.wait()
            self._signal_received = False
            self.preempted = True
            logger.warning("checkpoint manager: saved step %d after SIGTERM (preemption) into %s", step, location)
        return True

    def _land(self, dw: DistWrapper, label: str, then: Any = None, local: Any = None) -> None:
        """One collective step: the save in flight lands, ``local()`` runs, then ``then`` on the coordinator."""
        inflight, self._inflight = self._inflight, None

        def land() -> None:
            if inflight is not None:
                inflight[1].get_result()
            if local is not None:
                local()

        if inflight is None and then is None:
            return
        dw.all_reduce(label, land, then if then is not None else (lambda _: None))
        if inflight is not None:
            self._retention_due = True
            self._landed_step = inflight[0]

    def _settle_failed_step(self) -> None:
        """The step just started failed somewhere: wait for this rank's async save of it, not raising it."""
        inflight, self._inflight = self._inflight, None
        self._retention_due = True
        if inflight is None:
            return
        try:
            inflight[1].get_result()
            self._landed_step = inflight[0]
        except Exception as exc:  # noqa: BLE001 - the same failure, raised on every rank by the caller
            logger.info("checkpoint manager: this rank's async save of step %d ended with %s: %s", inflight[0],
                        type(exc).__name__, exc)

    def _retain(self, dw: DistWrapper, protected: frozenset[int], local_error: Optional[BaseException] = None,
                run: bool = True, label: str = "checkpoint manager: retention") -> list[int]:
        """Retention by the coordinator (``run=False``: none), raising ``local_error`` on every rank."""
        def check() -> None:
            if local_error is not None:
                raise local_error

        deleted: list[int] = dw.all_reduce(label, check,
                                           lambda _: self._apply_retention(protected) if run else [])
        if run:
            self._retention_due = False
            self._retained_once = True
            self._landed_step = None
        return deleted

    def _apply_retention(self, protected: frozenset[int]) -> list[int]:
        complete = self.all_steps()
        if not complete:
            return []
        best: frozenset[int] = frozenset()
        if self.keep_best is not None and self.keep_last is not None:
            best = frozenset(best_steps(self._metric_values(complete), self.keep_best, self.best_mode))
        doomed = steps_to_delete(complete, keep_last=self.keep_last, keep_every=self.keep_every, best=best,
                                 protected=protected, references={s: self._step_references(s) for s in complete})
        saved = self._landed_step
        # newer steps than the one just saved: a trainer went back with restore(step=K)
        newer = [s for s in complete if saved is not None and s > saved and s not in protected]
        if saved is not None and saved in complete and newer:
            logger.warning("checkpoint manager: step %d was just saved under %s, but newer step(s) %s exist: "
                           "retention and restore go by step number, so %s; to go back to an older step, "
                           "remove the newer steps or save into a new root", saved, self.root, newer[:5],
                           "retention deletes it now" if saved in doomed
                           else f"restore() would load step {max(complete)}, not this one")
        deleted = []
        for step in doomed:
            try:
                removed = self._steps.remove_step(step)
            except OSError as exc:  # the checkpoint just saved is durable: a failed deletion must not fail it
                logger.warning("checkpoint manager: could not delete step %d under %s: %s", step, self.root, exc)
                continue
            if removed:
                deleted.append(step)
                self._info_cache.pop(step, None)
            else:
                logger.info("checkpoint manager: step %d is being written or read; kept for now", step)
        newest = max(complete)
        cleaned = []
        for item in self._steps.find_leftovers(protected=protected, older_than=newest, max_step=newest):
            try:
                if self._steps.remove_leftover(item):
                    cleaned.append(item)
            except OSError as exc:
                logger.warning("checkpoint manager: could not remove %s: %s", item.location, exc)
        if deleted or cleaned:
            logger.info("checkpoint manager: retention under %s deleted step(s) %s, removed %d leftover(s) of "
                        "interrupted saves", self.root, deleted, len(cleaned))
        return deleted

    def _incremental_plan(self, step: int) -> dict[str, Any]:
        return incremental_plan([s for s in self.all_steps() if s < step] if self.incremental else [],
                                self._info, self.full_every)

    def _info(self, step: int) -> Optional[dict[str, Any]]:
        if step not in self._info_cache:
            self._info_cache[step] = self._steps.read_info(step)
        return self._info_cache[step]

    def _step_references(self, step: int) -> set[int]:
        if step not in self._references:
            self._references[step] = referenced_steps(self._steps.location(step), self._info(step))
        return self._references[step]

    def _metric_values(self, complete: list[int]) -> dict[int, float]:
        values = {}
        for step in complete:
            value = (_stored_metrics(self._info(step)) or {}).get(self.best_metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
                values[step] = float(value)
        return values

    def location(self, step: int) -> str:
        """The ``checkpoint_id`` of ``step`` (``root/step_N``); ``ValueError`` for a bad step."""
        return self._steps.location(check_count("step", step, low=0))

    def restore(self, state_dict: dict[str, Any], step: Optional[int] = None, *, verify: bool = True,
                required: bool = False, **load_kwargs: Any) -> Optional[int]:
        """Load the newest complete, intact step (or ``step``) into ``state_dict`` in place; returns it.

        A step damaged on any rank (:class:`CorruptCheckpointError`, :class:`CheckpointFormatError`,
        ``OSError``) is skipped on every rank with a warning, and the next older one is loaded.
        ``load_kwargs`` go to :func:`hyper_parallel_dcp.load`.  Collective.  With ``local``, the
        newest step complete in either tier; ``step=K`` reads the persistent tier only.

        Returns ``None`` when there is nothing to resume, after logging one line naming the root;
        ``required=True`` raises :class:`CheckpointNotFoundError` instead.  ``step=K`` loads that
        step or raises (:class:`CheckpointNotFoundError` when it is not complete, the load's error
        when it is damaged).  Other failures are raised as ``load`` raises them, on every rank;
        ``ValueError`` for a bad ``step``.
        """
        self._check_open()
        wanted = None if step is None else check_count("step", step, low=0)
        self.wait()
        if self.local is not None and wanted is None:
            restored = self.local.restore(state_dict, self.latest_step(), verify=verify,
                                          allow_partial_load=bool(load_kwargs.get("allow_partial_load")))
            if restored is not None:
                return restored
        dw = DistWrapper(None, use_dist=True)
        skipped: list[int] = []
        while True:
            with ExitStack() as held:
                chosen, skipped = dw.all_reduce(
                    "checkpoint manager: choose the step to restore", lambda: None,
                    functools.partial(self._choose_step, held, wanted, skipped))
                if chosen is None:
                    self._nothing_to_resume(dw, skipped, required)
                    return None
                error: Optional[BaseException] = None
                try:
                    api.load(state_dict, checkpoint_id=self._steps.location(chosen), verify=verify, **load_kwargs)
                except CheckpointTimeoutError:
                    raise  # a rank is gone: the step below would only wait for it
                except Exception as exc:  # noqa: BLE001 - every rank decides alike below
                    error = exc
                # every rank decides alike; the coordinator holds the step until all have read it
                outcomes = dw.all_gather(f"checkpoint manager: restore step {chosen}",
                                         functools.partial(_load_outcome, error))
            failed = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
            if not failed:
                if dw.is_coordinator:
                    logger.info("checkpoint manager: restored step %d from %s", chosen, self._steps.location(chosen))
                if self.local is not None:
                    self.local.forget_after(chosen)
                return chosen
            texts = {r: text for r, (_, text) in failed.items()}
            if wanted is not None or not all(damaged for damaged, _ in failed.values()):
                if error is not None:
                    raise error
                raise CheckpointException(f"restore step {chosen}", {**texts})
            if dw.is_coordinator:
                logger.warning("checkpoint manager: step %d under %s is damaged, loading the next older step "
                               "instead: %s", chosen, self.root, next(iter(texts.values()))
                               if len(set(texts.values())) == 1 else describe_failures(texts))
            skipped.append(chosen)

    def _choose_step(self, held: ExitStack, wanted: Optional[int], skipped: list[int],
                     _gathered: Any = None) -> tuple[Optional[int], list[int]]:
        """On the coordinator: ``wanted`` or the newest intact complete step not ``skipped``, held."""
        skipped = list(skipped)
        if wanted is not None:
            problems = self._steps.completeness_problems(wanted)
            if problems:
                raise CheckpointNotFoundError(
                    f"step {wanted} under {self.root} cannot be restored: {'; '.join(problems[:3])}")
            held.enter_context(self._steps.reading(wanted))
            return wanted, skipped
        for entry in reversed(self._steps.list_steps()):
            if not entry.complete or entry.step in skipped:
                continue
            problems = self._steps.completeness_problems(entry.step)
            if problems:
                logger.warning("checkpoint manager: step %d under %s is damaged, trying the next older step: %s",
                               entry.step, self.root, "; ".join(problems[:3]))
                skipped.append(entry.step)
                continue
            try:
                held.enter_context(self._steps.reading(entry.step))
            except CheckpointNotFoundError:
                continue  # removed meanwhile
            return entry.step, skipped
        return None, skipped

    def _nothing_to_resume(self, dw: DistWrapper, skipped: list[int], required: bool) -> None:
        """One line naming the root (the coordinator's), or, ``required``, the error on every rank."""
        if skipped:
            why = f"every complete step is damaged (skipped {', '.join(map(str, skipped))})"
        elif self._steps.list_steps():
            why = "no step there is complete"
        elif url_scheme(os.fspath(self.root)) == "file" and not os.path.exists(self.root):
            why = "it does not exist"
        else:
            why = "it holds no step_N directory"
        if required:
            raise CheckpointNotFoundError(f"nothing to resume under {self.root}: {why} (restore(required=True))")
        if dw.is_coordinator:
            logger.warning("checkpoint manager: nothing to resume under %s: %s; starting from scratch", self.root, why)

    def wait(self) -> None:
        """Return once every save in flight has landed and its retention is done (collective);
        re-raises on every rank, once, the error of an async save that failed."""
        self._check_open()
        if self.local is not None:
            self.local.wait()
        if self._inflight is None and not self._retention_due:
            return
        dw = DistWrapper(None, use_dist=True)
        self._land(dw, "checkpoint manager: land the save in flight")
        if self._retention_due:
            self._retain(dw, protected=frozenset())

    def close(self) -> None:
        """:meth:`wait`, then release the async writer process and the SIGTERM handler (idempotent;
        the manager cannot save or restore afterwards)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        """Close without a collective: the SIGTERM handler back, the writer stopped (once its part is written)."""
        self._closed = True
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self.async_save:
            async_persist.shutdown_writer()
        if self.local is not None:
            self.local.close(wait=False)  # close() waited; on an exception a peer may never come

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """:meth:`close`; on an exception without its collective (the other ranks may not come)."""
        if exc_type is None or self._closed:  # close() does nothing once closed
            self.close()
            return
        inflight, self._inflight = self._inflight, None
        if inflight is not None or self._retention_due:
            step = (f"step {inflight[0]} (in flight)" if inflight is not None else
                    "the last save" if self._landed_step is None else f"step {self._landed_step}")
            logger.warning("checkpoint manager: leaving on %s without a collective clean-up (the other ranks may "
                           "not come); the retention of %s runs at the next job's first save",
                           exc_type.__name__, step)
        try:
            self._release()
        except Exception:  # noqa: BLE001 - do not hide the exception that is already propagating
            logger.exception("checkpoint manager: closing failed while handling another exception")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.root!r}) is closed")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._signal_received = True
        logger.warning("checkpoint manager: SIGTERM received; the next save() saves and sets .preempted")

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every}, "
                f"save_interval_steps={self.save_interval_steps}, async_save={self.async_save})")
