"""The one wrapper through which every checkpoint collective goes (:class:`DistWrapper`): local
without a process group; with one, a failure on any rank is raised on every rank, and ranks
that do not check in at the store within :func:`collective_timeout` s raise
:class:`CheckpointTimeoutError` naming the phase and those ranks."""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from . import exit_drain
from .errors import (
    CheckpointException,
    CheckpointStoreLostError,
    CheckpointTimeoutError,
    format_ranks,
    remote_error_class,
)
from .settings import COLLECTIVE_TIMEOUT, DEFAULT_TIMEOUT_S, phase

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "DistWrapper", "collective_timeout", "default_store"]

#: Environment variable: seconds a rank waits for the others at each checkpoint collective.
TIMEOUT_ENV = COLLECTIVE_TIMEOUT.name


def collective_timeout() -> float:
    """Seconds to wait for all ranks at a collective (``HP_DCP_COLLECTIVE_TIMEOUT``; 0 = no check)."""
    return COLLECTIVE_TIMEOUT.get()


# per process group (by its global ranks): its store and the number of arrival checks made there
_arrivals: dict[tuple[int, ...], tuple[Any, int]] = {}


def _underlying(store: Any) -> Any:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _wait_all(store: Any, keys: list[str], timeout: float) -> None:
    """Until every key is set, at most ``timeout`` s; raises ``TimeoutError`` after that."""
    if not isinstance(_underlying(store), dist.FileStore):  # its wait sleeps 10 ms between looks
        store.wait(keys, timedelta(seconds=timeout))  # server-side wait: no polling traffic
        return
    deadline = time.monotonic() + timeout
    delay = 5e-5
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"keys not set within {timeout} s")
        time.sleep(delay)
        # at most 1 ms between looks (a look costs ~5 us of CPU)
        delay = min(delay * 2, 0.001)


def default_store() -> Any:
    """The key-value store of the default process group (a private torch API); raises without one."""
    return dist.distributed_c10d._get_default_store()


def _store_address(store: Any) -> str:
    """``host:port`` of a TCP store (under its prefixes), else what kind of store it is."""
    store = _underlying(store)
    if isinstance(store, dist.TCPStore):
        return f"TCP store at {store.host}:{store.port}"
    return type(store).__name__


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
        cls = None
        if self.module == "builtins":
            cls = getattr(builtins, self.qualname, None)
        elif self.module.startswith("hyper_parallel_dcp.") and "." not in self.qualname:
            with contextlib.suppress(ImportError):
                cls = getattr(importlib.import_module(self.module), self.qualname, None)
        return cls if isinstance(cls, type) and issubclass(cls, Exception) else None


def _failures(results: list[Any]) -> dict[int, _Failure]:
    return {r: v for r, v in enumerate(results) if isinstance(v, _Failure)}


def _raise_failures(step: str, failures: dict[int, _Failure]) -> None:
    """Raise one :class:`CheckpointException` for all failed ranks; where the class
    allows, also an instance of the first failure's class (``except KeyError`` works)."""
    if not failures:
        return
    described: dict[int, BaseException | str] = {r: f"{f.qualname}: {f.message}" for r, f in failures.items()}
    cls = failures[min(failures)].exception_type()
    exc = CheckpointException(step, described)
    if cls is not None and not issubclass(cls, CheckpointException):
        with contextlib.suppress(TypeError):  # a class that cannot be combined: the plain one
            exc = remote_error_class(cls)(step, described)
    exc.remote_tracebacks = {r: f.trace for r, f in failures.items()}  # type: ignore[attr-defined]
    raise exc


def _result(step: str, tagged: tuple[str, Any]) -> Any:
    """The value of an ``("ok", value)`` answer; raises the failures of a ``("fail", ...)`` one."""
    tag, value = tagged
    if tag == "fail":
        _raise_failures(step, value)
    return value


class DistWrapper:
    """Collectives over ``group`` with failure propagation; a no-op without a group."""

    def __init__(self, group: Optional[dist.ProcessGroup], use_dist: bool, coordinator_rank: int = 0, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 timeout: Optional[float] = None) -> None:
        """Collectives over ``group`` (``None``: the default group) when ``use_dist``.

        ``rank`` and ``world_size`` (without ``group``): a wrapper for a process outside the job's
        group (the async writer; a subclass may exchange another way), without arrival check.
        ``timeout`` defaults to ``HP_DCP_COLLECTIVE_TIMEOUT``.  Raises ``ValueError`` for a
        ``rank`` outside ``world_size``."""
        self.group = group
        self.coordinator_rank = coordinator_rank
        self.global_coordinator = coordinator_rank
        self.timeout = collective_timeout() if timeout is None else timeout
        self._step = "collective"
        self._round = ""  # names a step's second exchange of one kind (see exchange_name)
        self._store: Any = None
        self._group_ranks: tuple[int, ...] = ()
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
                # let gloo's worker threads finish at exit (see exit_drain)
                exit_drain.install()
                self.rank = dist.get_rank(group)
                self.world_size = dist.get_world_size(group)
                if group is not None:
                    self.global_coordinator = dist.get_global_rank(group, coordinator_rank)
            else:
                self.rank, self.world_size = 0, 1
            if self.use_dist and self.timeout > 0:
                with contextlib.suppress(Exception):  # a private API: without it, no arrival check
                    self._store = default_store()
                self._group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                    range(self.world_size))
        self.is_coordinator = self.rank == coordinator_rank

    # -- arrival check ---------------------------------------------------------------
    def _arrive(self, collective: str) -> None:
        """Check in at the store and wait for every rank of the group; raise naming the absent."""
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
        try:
            store.set(keys[self.rank], b"1")
            _wait_all(store, keys, self.timeout)
        except Exception as exc:  # noqa: BLE001 - a store timeout, or the store itself is gone
            try:
                present = [store.check([key]) for key in keys]
            except Exception:  # noqa: BLE001 - nobody can be told apart as alive or dead now
                raise CheckpointStoreLostError(
                    f"checkpoint phase '{self._step}' ({collective}): the job's {_store_address(store)} went away "
                    f"while rank {self._global_rank()} waited there for the others ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); the process hosting it died (rank 0, unless "
                    "a launcher's agent hosts the store, as torchrun's does). Restart the job.",
                    self._step) from None
            missing = [self._group_ranks[r] if self._group_ranks else r for r, ok in enumerate(present) if not ok]
            if not missing:
                raise
            raise CheckpointTimeoutError(
                f"checkpoint phase '{self._step}' ({collective}): rank(s) [{format_ranks(missing)}] did not "
                f"arrive within {self.timeout:g} s (waiting on rank {self._global_rank()}); they died, hang, or "
                f"are still working. Set {TIMEOUT_ENV} to wait longer.",
                self._step,
                tuple(missing),
            ) from None
        if seq > 1:
            with contextlib.suppress(Exception):  # only housekeeping
                store.delete_key(f"{name}/{seq - 1}/{self.rank}")

    def exchange_name(self) -> str:
        """The exchange under way: its step, suffixed for a step's second exchange of one kind."""
        return f"{self._step}-{self._round}" if self._round else self._step

    def arrive(self, step: str) -> None:
        """Wait (at most the collective timeout) until every rank of the group got here (for
        callers that run their own collectives); raises :class:`CheckpointTimeoutError`."""
        if self.use_dist:
            self._step = step
            self._arrive("arrival")

    @functools.cached_property
    def _flags_on_cpu(self) -> bool:
        """Whether ``check`` may agree through an ``all_reduce`` of a CPU tensor: the raw
        collectives are this class's own and the group's backend includes gloo."""
        if type(self).all_gather_object is not DistWrapper.all_gather_object:
            return False
        try:
            return "gloo" in str(dist.get_backend(self.group))
        except Exception:  # noqa: BLE001 - no backend to ask: the object path
            return False

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
        _raise_failures(step, _failures(results))
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
        return _result(step, self.broadcast_object(payload))

    def _reduce(self, gathered: Optional[list[Any]], reduce_fun: Callable[[list[Any]], Any]) -> tuple[str, Any]:
        """On the coordinator: ``("ok", reduce_fun(gathered))``, or ``("fail", failures)``."""
        assert gathered is not None
        failures = _failures(gathered)
        if failures:
            return "fail", failures
        reduced = self._run(lambda: reduce_fun(gathered))
        return ("fail", {self.rank: reduced}) if isinstance(reduced, _Failure) else ("ok", reduced)

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
            tag, value = self._reduce(gathered, reduce_fun)
            payload = [(tag, value)] * self.world_size if tag == "fail" else [("ok", r) for r in value]
        return _result(step, self.scatter_object(payload))

    def all_reduce(self, step: str, map_fun: Callable[[], T], reduce_fun: Callable[[list[T]], R]) -> R:
        """Map on every rank, reduce on the coordinator, broadcast the one result."""
        self._step = step
        local = self._run(map_fun)
        if not self.use_dist:
            return reduce_fun([local])  # type: ignore[list-item]
        gathered = self.gather_object(local)
        return _result(step, self.broadcast_object(self._reduce(gathered, reduce_fun) if self.is_coordinator else None))

    def all_reduce_confirmed(self, step: str, map_fun: Callable[[], T], prepare_fun: Callable[[list[T]], P],
                             confirm_fun: Callable[[], None], commit_fun: Callable[[P], None]) -> P:
        """Every rank maps; the coordinator runs ``prepare_fun(results)``, whose result every rank
        gets and returns; each rank runs ``confirm_fun``; once all confirmed the coordinator runs
        ``commit_fun(prepared)``.  A failure anywhere is raised on every rank after the confirmations."""
        self._step = step
        if not self.use_dist:
            value = prepare_fun([map_fun()])
            confirm_fun()
            commit_fun(value)
            return value
        gathered = self.gather_object(self._run(map_fun))
        failures: dict[int, _Failure] = {}
        prepared: Any = None
        if self.is_coordinator:
            tag, prepared = self._reduce(gathered, prepare_fun)
            if tag == "fail":
                failures, prepared = prepared, None
        shared = self._second_exchange("share", lambda: self.broadcast_object(prepared))
        confirmed = self._run(confirm_fun)
        confirmations = self._second_exchange("confirm", lambda: self.gather_object(confirmed))
        payload: Any = None
        if self.is_coordinator:
            assert confirmations is not None
            for r, failure in _failures(confirmations).items():
                failures.setdefault(r, failure)
            if not failures:
                committed = self._run(lambda: commit_fun(prepared))
                if isinstance(committed, _Failure):
                    failures[self.rank] = committed
            payload = ("fail", failures) if failures else ("ok", None)
        _result(step, self.broadcast_object(payload))
        return shared

    def _second_exchange(self, name: str, exchange: Callable[[], T]) -> T:
        """``exchange()`` under a name of its own: a step's second exchange of one kind."""
        self._round = name
        try:
            return exchange()
        finally:
            self._round = ""

    def check(self, step: str, local_error: Optional[BaseException]) -> None:
        """Raise on every rank if any rank reports an error (a flag ``all_reduce`` first where it can)."""
        self._step = step
        if not self.use_dist:
            if local_error is not None:
                raise local_error
            return
        if self._flags_on_cpu:
            self._arrive("all_reduce")
            with phase("all_reduce", self.rank):
                flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not flag.item():
                return
        mine = _Failure.capture(local_error) if local_error is not None else None
        _raise_failures(step, _failures(self.all_gather_object(mine)))
