"""``DataCopier``: how a non-tensor leaf is snapshotted while staging an async save (nothing
staged may alias the caller's state).  Exports :class:`DataCopier` and :func:`host_copy`."""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable, TypeVar

import torch

from ._torch_compat import dtensor_class

__all__ = ["DataCopier", "host_copy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
CopyFn = Callable[[Any], Any]


def _accelerator_present() -> bool:
    try:
        return torch.accelerator.is_available()
    except Exception:  # noqa: BLE001 - a broken accelerator runtime means: none
        return False


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached host copy of ``tensor`` (pinned where an accelerator exists); of a DTensor,
    its local shard (the device mesh cannot travel to the writer process)."""
    dtensor_cls = dtensor_class()
    if dtensor_cls is not None and isinstance(tensor, dtensor_cls):
        tensor = tensor.to_local()
    tensor = tensor.detach()
    pin = tensor.device.type != "cpu" and _accelerator_present()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    out.copy_(tensor)
    return out


class DataCopier:
    """Registry of staging copy functions: ``@DataCopier.register(MyState)`` registers
    ``fn(obj) -> host copy``; ``copy(obj)`` uses the handler of ``type(obj)`` or its most
    derived registered base, else ``copy.deepcopy`` (warning once per type)."""

    _handlers: dict[type, CopyFn] = {}
    _warned: set[type] = set()
    _lock = threading.Lock()

    @classmethod
    def register(cls, obj_type: type) -> Callable[[Callable[[T], T]], Callable[[T], T]]:
        """Decorator registering ``fn`` as the staging copy of ``obj_type`` (replacing any
        earlier one); ``TypeError`` when ``obj_type`` is not a class."""
        if not isinstance(obj_type, type):
            raise TypeError(f"DataCopier.register expects a class, got {obj_type!r}")

        def decorator(fn: Callable[[T], T]) -> Callable[[T], T]:
            with cls._lock:
                cls._handlers[obj_type] = fn
                cls._warned.discard(obj_type)
            return fn

        return decorator

    @classmethod
    def copy(cls, obj: Any) -> Any:
        """A copy of ``obj`` that shares no mutable state with it; ``obj`` is not modified."""
        # the type itself, then the most derived registered base first
        fn = next((cls._handlers[base] for base in type(obj).__mro__ if base in cls._handlers), None)
        if fn is not None:
            return fn(obj)
        if type(obj) not in cls._warned:
            with cls._lock:
                cls._warned.add(type(obj))
            logger.warning(
                "async_save: no DataCopier registered for %s.%s; staging it with copy.deepcopy "
                "(register one with @DataCopier.register(%s))",
                type(obj).__module__, type(obj).__qualname__, type(obj).__name__,
            )
        return copy.deepcopy(obj)


for _t in (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size):
    DataCopier.register(_t)(lambda obj: obj)  # immutable: staged as is
DataCopier.register(torch.Tensor)(host_copy)


@DataCopier.register(dict)
def _copy_dict(obj: dict) -> dict:
    out = copy.copy(obj)  # keeps the dict subclass (OrderedDict, defaultdict)
    for key, value in obj.items():
        out[key] = DataCopier.copy(value)
    return out


@DataCopier.register(list)
@DataCopier.register(tuple)
def _copy_sequence(obj: Any) -> Any:
    # a namedtuple or another list or tuple subclass: its own copy logic runs
    return type(obj)(DataCopier.copy(v) for v in obj) if type(obj) in (list, tuple) else copy.deepcopy(obj)
