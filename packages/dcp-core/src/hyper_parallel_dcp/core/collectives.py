"""The one wrapper through which every checkpoint collective goes.

Without a process group (or with ``use_dist=False``) each call just runs locally.  With
one, a step's local function runs inside a try; failures travel with the data, and a
failure on *any* rank is raised on *every* rank (naming the rank) instead of leaving the
others waiting in the next collective.
"""

from __future__ import annotations

import builtins
import importlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from .errors import CheckpointException
from .timing import phase

__all__ = ["DistWrapper"]

T = TypeVar("T")
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
    described = {r: f"{f.qualname}: {f.message}" for r, f in failures.items()}
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

    def __init__(self, group: Optional[dist.ProcessGroup], use_dist: bool, coordinator_rank: int = 0):
        self.group = group
        self.use_dist = use_dist and dist.is_available() and dist.is_initialized()
        if self.use_dist:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_coordinator = (
                dist.get_global_rank(group, coordinator_rank) if group is not None else coordinator_rank
            )
        else:
            self.rank = 0
            self.world_size = 1
            self.global_coordinator = coordinator_rank
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank

    # -- raw object collectives ------------------------------------------------------
    def all_gather_object(self, obj: T) -> list[T]:
        if not self.use_dist:
            return [obj]
        with phase("all_gather_object", self.rank):
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: T) -> Optional[list[T]]:
        if not self.use_dist:
            return [obj]
        with phase("gather_object", self.rank):
            out: Optional[list[Any]] = [None] * self.world_size if self.is_coordinator else None
            dist.gather_object(obj, out, dst=self.global_coordinator, group=self.group)
        return out

    def scatter_object(self, objs: Optional[list[T]]) -> T:
        if not self.use_dist:
            assert objs is not None
            return objs[0]
        with phase("scatter_object", self.rank):
            out: list[Any] = [None]
            dist.scatter_object_list(out, objs if self.is_coordinator else None,
                                     src=self.global_coordinator, group=self.group)
        return out[0]

    def broadcast_object(self, obj: Optional[T]) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        with phase("broadcast_object", self.rank):
            box = [obj if self.is_coordinator else None]
            dist.broadcast_object_list(box, src=self.global_coordinator, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.use_dist:
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
        local = self._run(map_fun)
        results = self.all_gather_object(local)
        _raise_failures(step, {r: v for r, v in enumerate(results) if isinstance(v, _Failure)})
        return results  # type: ignore[return-value]

    def reduce_scatter(self, step: str, map_fun: Callable[[], T],
                       reduce_fun: Callable[[list[T]], list[R]]) -> R:
        """Map on every rank, reduce on the coordinator, scatter one result per rank."""
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

    def check(self, step: str, local_error: Optional[BaseException]) -> None:
        """Collective error check: raise on every rank if any rank reports an error."""
        if not self.use_dist:
            if local_error is not None:
                raise local_error
            return
        mine = _Failure.capture(local_error) if local_error is not None else None
        results = self.all_gather_object(mine)
        _raise_failures(step, {r: v for r, v in enumerate(results) if isinstance(v, _Failure)})
