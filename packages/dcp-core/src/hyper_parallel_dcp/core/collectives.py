"""The one wrapper through which every checkpoint collective goes.

Without a process group (or with ``use_dist=False``) each call just runs locally.  With
one, a step's local function runs inside a try; failures travel with the data, and a
failure on *any* rank is raised on *every* rank (naming the rank) instead of leaving the
others waiting in the next collective.

A rank that dies or hangs cannot report a failure, so before each collective every rank
also checks in at the process group's key-value store and waits (at most
:func:`collective_timeout` seconds, env ``HP_DCP_COLLECTIVE_TIMEOUT``, default 30 min) for
the others; when some never arrive, :class:`CheckpointTimeoutError` names the phase and
those ranks instead of hanging in the collective.
"""

from __future__ import annotations

import builtins
import importlib
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from . import exit_drain
from .errors import CheckpointException, CheckpointTimeoutError, format_ranks
from .settings import COLLECTIVE_TIMEOUT, DEFAULT_TIMEOUT_S
from .timing import phase

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "DistWrapper", "collective_timeout"]

#: Environment variable: seconds a rank waits for the others at each checkpoint collective.
TIMEOUT_ENV = COLLECTIVE_TIMEOUT.name


def collective_timeout() -> float:
    """Seconds to wait for all ranks at a collective (``HP_DCP_COLLECTIVE_TIMEOUT``; 0 = no check).

    Raises :class:`~hyper_parallel_dcp.core.settings.SettingError` (a ``ValueError``)
    naming the variable when it is not a number of seconds >= 0.
    """
    return COLLECTIVE_TIMEOUT.get()


# Per process group (by its global ranks): the store it was last used with and the number
# of arrival checks made there.  Every member makes the same checks in the same order,
# so the counter names the same check on every rank.
_arrivals: dict[tuple[int, ...], tuple[Any, int]] = {}


def _polls_slowly(store: Any) -> bool:
    """A FileStore's ``wait`` sleeps 10 ms between looks: poll it ourselves instead."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.FileStore)


def _wait_all(store: Any, keys: list[str], timeout: float) -> None:
    """Until every key is set, at most ``timeout`` s; raises ``TimeoutError`` after that."""
    if not _polls_slowly(store):
        store.wait(keys, timedelta(seconds=timeout))  # server-side wait: no polling traffic
        return
    deadline = time.monotonic() + timeout
    delay = 5e-5
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"keys not set within {timeout} s")
        time.sleep(delay)
        # At most 1 ms between looks: doubling from 50 us up to a 10 ms cap, a rank
        # arriving 7 ms late was seen 5.75 ms after it arrived, at each of a save's or a
        # load's ~5 checks (a whole save of 1000 small tensors takes ~0.1 s); a look at a
        # FileStore costs ~5 us of CPU (measured, 200 keys).
        delay = min(delay * 2, 0.001)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it there is no arrival check
        return None

T = TypeVar("T")
P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True)
class _Failure:
    """A picklable description of an exception raised on some rank."""

    module: str
    qualname: str
    message: str
    trace: str

    @classmethod
    def capture(cls, exc: BaseException) -> _Failure:
        return cls(type(exc).__module__, type(exc).__qualname__, str(exc),
                   "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))

    def exception_type(self) -> Optional[type]:
        """The original class, when it is safe to import (builtins or ours)."""
        if self.module == "builtins":
            cls = getattr(builtins, self.qualname, None)
        elif self.module.startswith("hyper_parallel_dcp.") and "." not in self.qualname:
            try:
                cls = getattr(importlib.import_module(self.module), self.qualname, None)
            except ImportError:
                cls = None
        else:
            cls = None
        return cls if isinstance(cls, type) and issubclass(cls, Exception) else None


def _raise_failures(step: str, failures: dict[int, _Failure]) -> None:
    """Raise one exception for all failed ranks, of the first failure's class if possible.

    The raised exception is a :class:`CheckpointException` and, where the class allows,
    also an instance of the original exception class (so ``except KeyError`` still works).
    """
    if not failures:
        return
    described: dict[int, BaseException | str] = {r: f"{f.qualname}: {f.message}" for r, f in failures.items()}
    first = failures[min(failures)]
    cls = first.exception_type()
    exc: CheckpointException
    if cls is not None and not issubclass(cls, CheckpointException):
        try:
            combined = type(cls.__name__, (CheckpointException, cls), {"__module__": cls.__module__,
                                                                        "__str__": CheckpointException.__str__})
            exc = combined(step, described)
        except TypeError:  # layout conflict with a builtin base
            exc = CheckpointException(step, described)
    else:
        exc = CheckpointException(step, described)
    exc.remote_tracebacks = {r: f.trace for r, f in failures.items()}  # type: ignore[attr-defined]
    raise exc


class DistWrapper:
    """Collectives over ``group`` with failure propagation; a no-op without a group."""

    def __init__(self, group: Optional[dist.ProcessGroup], use_dist: bool, coordinator_rank: int = 0, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 timeout: Optional[float] = None) -> None:
        """Collectives over ``group`` (``None``: the default group) when ``use_dist``.

        ``rank`` and ``world_size`` make a wrapper for a process that belongs to a job
        without being in its process group (the async writer): ``group`` must then be
        ``None``; with ``use_dist=False`` every collective is the single-process no-op, and
        a subclass that exchanges objects another way (files) passes ``use_dist=True`` and
        overrides the raw object collectives.  Such a wrapper runs no arrival check (that
        needs a group's store).  ``timeout`` defaults to ``HP_DCP_COLLECTIVE_TIMEOUT``.
        Raises ``ValueError`` for a ``rank`` outside ``world_size``.
        """
        self.group = group
        self.coordinator_rank = coordinator_rank
        self.global_coordinator = coordinator_rank
        self.timeout = collective_timeout() if timeout is None else timeout
        self._step = "collective"
        self._round = ""  # names a step's second exchange of one kind (see exchange_name)
        self._store: Any = None
        self._group_ranks: tuple[int, ...] = ()
        self._cpu_flags: Optional[bool] = None  # see _flags_on_cpu
        if rank is not None or world_size is not None:
            if group is not None or rank is None or world_size is None:
                raise ValueError("rank and world_size go together, and without a process group")
            if not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} outside world size {world_size}")
            self.use_dist = use_dist
            self.rank, self.world_size = rank, world_size
        else:
            self.use_dist = use_dist and dist.is_available() and dist.is_initialized()
            if self.use_dist:
                # A gloo worker thread may still be releasing this wrapper's last collective
                # when the script exits: let it finish first (see exit_drain).
                exit_drain.install()
                self.rank = dist.get_rank(group)
                self.world_size = dist.get_world_size(group)
                if group is not None:
                    self.global_coordinator = dist.get_global_rank(group, coordinator_rank)
            else:
                self.rank, self.world_size = 0, 1
            if self.use_dist and self.timeout > 0:
                self._store = _default_store()
                self._group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                    range(self.world_size))
        self.is_coordinator = self.rank == coordinator_rank

    # -- arrival check ---------------------------------------------------------------
    def _arrive(self, collective: str) -> None:
        """Check in at the store and wait for every rank of the group; raise naming the absent.

        One ``set`` and one ``wait`` on the store per collective; the previous check's key
        is deleted once everybody has passed the current one.
        """
        if self._store is None:
            return
        store = self._store
        gid = self._group_ranks
        last_store, seq = _arrivals.get(gid, (None, 0))
        if last_store is not store:
            seq = 0
        seq += 1
        _arrivals[gid] = (store, seq)
        name = "hp-dcp/arrive/" + ",".join(map(str, gid)) if len(gid) <= 16 else f"hp-dcp/arrive/{hash(gid):x}"
        keys = [f"{name}/{seq}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], b"1")
        try:
            _wait_all(store, keys, self.timeout)
        except Exception:  # noqa: BLE001 - a store timeout, or the store itself is gone
            missing = []
            for r, key in enumerate(keys):
                try:
                    present = store.check([key])
                except Exception:  # noqa: BLE001
                    present = False
                if not present:
                    missing.append(self._group_ranks[r] if self._group_ranks else r)
            if not missing:
                raise
            raise CheckpointTimeoutError(
                f"checkpoint phase '{self._step}' ({collective}): rank(s) [{format_ranks(missing)}] did not arrive within "
                f"{self.timeout:g} s (waiting on rank {self._global_rank()}); they died, hang, or are still "
                f"working. Set {TIMEOUT_ENV} to wait longer.",
                self._step,
                tuple(missing),
            ) from None
        if seq > 1:
            try:
                store.delete_key(f"{name}/{seq - 1}/{self.rank}")
            except Exception:  # noqa: BLE001 - only housekeeping
                pass

    def exchange_name(self) -> str:
        """The name of the exchange under way: its step, suffixed for a step's second
        exchange of one kind.  Errors name the step; a wrapper that exchanges through
        named files names them by this."""
        return f"{self._step}-{self._round}" if self._round else self._step

    def arrive(self, step: str) -> None:
        """Wait (at most the collective timeout) until every rank of the group got here.

        For callers that run their own collectives (the broadcast load): raises
        :class:`CheckpointTimeoutError` naming ``step`` and the ranks that never arrived.
        Every member must call it at the same point.
        """
        if self.use_dist:
            self._step = step
            self._arrive("arrival")

    def _flags_on_cpu(self) -> bool:
        """Whether ``check`` may agree through an ``all_reduce`` of a CPU tensor: the raw
        collectives are this class's own (a subclass may exchange objects as files) and the
        group's backend includes gloo (``gloo``, ``cpu:gloo,cuda:nccl``).  The same on every
        rank of the group."""
        ok = self._cpu_flags
        if ok is None:
            ok = type(self).all_gather_object is DistWrapper.all_gather_object
            if ok:
                try:
                    ok = "gloo" in str(dist.get_backend(self.group))
                except Exception:  # noqa: BLE001 - no backend to ask: the object path
                    ok = False
            self._cpu_flags = ok
        return ok

    def _global_rank(self) -> int:
        return self._group_ranks[self.rank] if self._group_ranks else self.rank

    # -- raw object collectives ------------------------------------------------------
    def all_gather_object(self, obj: T) -> list[T]:
        if not self.use_dist:
            return [obj]
        self._arrive("all_gather_object")
        with phase("all_gather_object", self.rank):
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: T) -> Optional[list[T]]:
        if not self.use_dist:
            return [obj]
        self._arrive("gather_object")
        with phase("gather_object", self.rank):
            out: Optional[list[Any]] = [None] * self.world_size if self.is_coordinator else None
            dist.gather_object(obj, out, dst=self.global_coordinator, group=self.group)
        return out

    def scatter_object(self, objs: Optional[list[T]]) -> T:
        if not self.use_dist:
            assert objs is not None
            return objs[0]
        self._arrive("scatter_object")
        with phase("scatter_object", self.rank):
            out: list[Any] = [None]
            dist.scatter_object_list(out, objs if self.is_coordinator else None,
                                     src=self.global_coordinator, group=self.group)
        return out[0]

    def broadcast_object(self, obj: Optional[T]) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        self._arrive("broadcast_object")
        with phase("broadcast_object", self.rank):
            box = [obj if self.is_coordinator else None]
            dist.broadcast_object_list(box, src=self.global_coordinator, group=self.group)
        return box[0]  # type: ignore[return-value]  # every rank holds the coordinator's object now

    def barrier(self) -> None:
        if self.use_dist:
            self._arrive("barrier")
            dist.barrier(group=self.group)

    # -- steps with failure propagation ----------------------------------------------
    def _run(self, fn: Callable[[], T]) -> T | _Failure:
        if not self.use_dist:
            return fn()  # single process: the original exception, untouched
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - shipped to every rank below
            return _Failure.capture(exc)

    def all_gather(self, step: str, map_fun: Callable[[], T]) -> list[T]:
        """Every rank runs ``map_fun``; every rank gets all results (or every rank raises)."""
        self._step = step
        local = self._run(map_fun)
        results = self.all_gather_object(local)
        _raise_failures(step, {r: v for r, v in enumerate(results) if isinstance(v, _Failure)})
        return results  # type: ignore[return-value]

    def broadcast_step(self, step: str, fun: Callable[[], T]) -> T:
        """The coordinator runs ``fun``; every rank gets its result (or every rank raises)."""
        self._step = step
        if not self.use_dist:
            return fun()
        payload: Any = None
        if self.is_coordinator:
            result = self._run(fun)
            payload = ("fail", {self.rank: result}) if isinstance(result, _Failure) else ("ok", result)
        tag, value = self.broadcast_object(payload)
        if tag == "fail":
            _raise_failures(step, value)
        return value

    def reduce_scatter(self, step: str, map_fun: Callable[[], T],
                       reduce_fun: Callable[[list[T]], list[R]]) -> R:
        """Map on every rank, reduce on the coordinator, scatter one result per rank."""
        self._step = step
        local = self._run(map_fun)
        if not self.use_dist:
            return reduce_fun([local])[0]  # type: ignore[list-item]
        gathered = self.gather_object(local)
        payload: Optional[list[Any]] = None
        if self.is_coordinator:
            assert gathered is not None
            failures = {r: v for r, v in enumerate(gathered) if isinstance(v, _Failure)}
            if failures:
                payload = [("fail", failures)] * self.world_size
            else:
                reduced = self._run(lambda: reduce_fun(gathered))  # type: ignore[arg-type]
                if isinstance(reduced, _Failure):
                    payload = [("fail", {self.rank: reduced})] * self.world_size
                else:
                    payload = [("ok", r) for r in reduced]
        tag, value = self.scatter_object(payload)
        if tag == "fail":
            _raise_failures(step, value)
        return value

    def all_reduce(self, step: str, map_fun: Callable[[], T], reduce_fun: Callable[[list[T]], R]) -> R:
        """Map on every rank, reduce on the coordinator, broadcast the one result."""
        self._step = step
        local = self._run(map_fun)
        if not self.use_dist:
            return reduce_fun([local])  # type: ignore[list-item]
        gathered = self.gather_object(local)
        payload: Any = None
        if self.is_coordinator:
            assert gathered is not None
            failures = {r: v for r, v in enumerate(gathered) if isinstance(v, _Failure)}
            if failures:
                payload = ("fail", failures)
            else:
                reduced = self._run(lambda: reduce_fun(gathered))  # type: ignore[arg-type]
                payload = ("fail", {self.rank: reduced}) if isinstance(reduced, _Failure) else ("ok", reduced)
        tag, value = self.broadcast_object(payload)
        if tag == "fail":
            _raise_failures(step, value)
        return value

    def all_reduce_confirmed(self, step: str, map_fun: Callable[[], T], prepare_fun: Callable[[list[T]], P],
                             confirm_fun: Callable[[], None], commit_fun: Callable[[P], None]) -> P:
        """Gather, prepare and share on the coordinator, confirm everywhere, then commit.

        Every rank runs ``map_fun`` and sends the result to the coordinator, which runs
        ``prepare_fun(results)`` and sends what it returns to every rank; each rank then
        runs ``confirm_fun``; once every rank confirmed, the coordinator runs
        ``commit_fun(prepared)``, and every rank returns ``prepared``.  A save sends its write
        results before its files are durable and confirms once they are: the coordinator
        builds the metadata and every rank receives it while the data is flushed, and the
        commit follows every confirmation.  A failure of any function on any rank is raised
        on every rank, after the confirmations.  Without a process group: map, prepare,
        confirm, commit, exceptions unchanged.
        """
        self._step = step
        if not self.use_dist:
            value = prepare_fun([map_fun()])
            confirm_fun()
            commit_fun(value)
            return value
        local = self._run(map_fun)
        gathered = self.gather_object(local)
        failures: dict[int, _Failure] = {}
        prepared: Any = None
        if self.is_coordinator:
            assert gathered is not None
            failures = {r: v for r, v in enumerate(gathered) if isinstance(v, _Failure)}
            if not failures:
                prepared = self._run(lambda: prepare_fun(gathered))  # type: ignore[arg-type]
                if isinstance(prepared, _Failure):
                    failures[self.rank] = prepared
                    prepared = None
        # Each exchange of the step past the first of its kind gets a name of its own.
        self._round = "share"
        try:
            shared = self.broadcast_object(prepared)
        finally:
            self._round = ""
        confirmed = self._run(confirm_fun)
        self._round = "confirm"
        try:
            confirmations = self.gather_object(confirmed)
        finally:
            self._round = ""
        payload: Any = None
        if self.is_coordinator:
            assert confirmations is not None
            for r, v in enumerate(confirmations):
                if isinstance(v, _Failure):
                    failures.setdefault(r, v)
            if not failures:
                committed = self._run(lambda: commit_fun(prepared))
                if isinstance(committed, _Failure):
                    failures[self.rank] = committed
            payload = ("fail", failures) if failures else ("ok", None)
        tag, value = self.broadcast_object(payload)
        if tag == "fail":
            _raise_failures(step, value)
        return shared

    def check(self, step: str, local_error: Optional[BaseException]) -> None:
        """Collective error check: raise on every rank if any rank reports an error.

        Where the group takes CPU tensors, one ``all_reduce`` of a flag says whether any
        rank failed, and the failures are gathered only then: on gloo (2 ranks) the
        ``all_gather_object`` of ``None`` took 0.8 ms median and 4 ms at the 90th
        percentile, its two collectives and pickles against 0.2 / 0.3 ms for the flag.
        """
        self._step = step
        if not self.use_dist:
            if local_error is not None:
                raise local_error
            return
        if self._flags_on_cpu():
            self._arrive("all_reduce")
            with phase("all_reduce", self.rank):
                flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not flag.item():
                return
        mine = _Failure.capture(local_error) if local_error is not None else None
        results = self.all_gather_object(mine)
        _raise_failures(step, {r: v for r, v in enumerate(results) if isinstance(v, _Failure)})
