"""torch's ``Stateful`` leaves (objects with ``state_dict()`` and ``load_state_dict()``): as in
``torch.distributed.checkpoint``, a save stores ``state_dict()`` in their place and a load
hands the filled state dict to ``load_state_dict``; found under dict values at any depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["expand_stateful", "is_stateful", "restore_stateful"]

Found = list[tuple[tuple[Any, ...], Any]]

#: Values never stateful: tensors (and DTensors), numbers, strings.
_LEAF_TYPES = (torch.Tensor, int, float, str, bytes)


def is_stateful(obj: Any) -> bool:
    """True for an object (not a class, not a mapping) with callable ``state_dict`` and
    ``load_state_dict``: torch's ``Stateful`` protocol (``nn.Module`` and optimizers too)."""
    return (not isinstance(obj, (type, Mapping)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def expand_stateful(state_dict: Mapping[str, Any]) -> tuple[Any, Found]:
    """Replace every stateful value by its ``state_dict()``; returns ``(expanded, found)``.

    Only the dicts on the path to a stateful value are copied; ``found`` lists ``(path,
    object)``.  Without any, the same ``state_dict`` comes back and ``found`` is empty.
    """
    found: Found = []

    def visit(node: Mapping[str, Any], path: tuple[Any, ...]) -> Mapping[str, Any]:
        out: dict[Any, Any] | None = None
        for key, value in node.items():
            new = value
            if isinstance(value, _LEAF_TYPES):  # most values: no attribute lookups
                continue
            if is_stateful(value):
                new = value.state_dict()
                found.append((path + (key,), value))
            elif isinstance(value, Mapping):
                new = visit(value, path + (key,))
            if new is not value:
                if out is None:
                    out = dict(node)
                out[key] = new
        return node if out is None else out

    return visit(state_dict, ()), found


def _write_back(original: Any, expanded: Any) -> None:
    """Put what a load replaced in the copied dicts back into the caller's dicts."""
    for key, value in original.items():
        new = expanded[key]
        if is_stateful(value) or new is value:
            continue
        if isinstance(value, dict) and isinstance(new, Mapping):
            _write_back(value, new)
        else:
            original[key] = new


def restore_stateful(original: Any, expanded: Any, found: Found) -> None:
    """After a load into ``expanded``: call each object's ``load_state_dict`` with its loaded
    state dict, and copy replaced non-tensor values back into ``original``."""
    if not found:
        return
    for path, obj in found:
        node = expanded
        for key in path:
            node = node[key]
        obj.load_state_dict(node)
    _write_back(original, expanded)
