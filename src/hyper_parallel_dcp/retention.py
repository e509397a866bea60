"""Which complete checkpoints a :class:`CheckpointManager` keeps: a pure function of step numbers.

Kept: the newest ``keep_last``, multiples of ``keep_every``, the best ``keep_best``, the
newest complete and every ``protected`` step, and every step a kept step points into
(SPEC §14).  Everything else that is complete is deleted.  :func:`check_count` validates
these counts and the other integer settings of a manager and its tiers.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from hyper_parallel_dcp.core.backends import parse_step_name
from hyper_parallel_dcp.core.metadata import referenced_checkpoint
from hyper_parallel_dcp.storage_fs.metadata_io import load_checkpoint_metadata

__all__ = ["best_steps", "check_count", "incremental_plan", "referenced_steps", "steps_to_delete"]


def check_count(what: str, value: Any, low: int = 1, optional: bool = False) -> Any:
    """``value`` as an ``int`` when it is an integer >= ``low`` (``optional``: or ``None``, kept);
    ``ValueError`` naming ``what`` and ``value`` otherwise (a ``bool`` is no integer here)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{what} must be {'None or ' if optional else ''}an integer >= {low}, got {value!r}")
    return int(value)


def incremental_plan(earlier: Sequence[int], info_of: Callable[[int], Optional[dict[str, Any]]],
                     full_every: Optional[int]) -> dict[str, Any]:
    """What a manager stores in a step's info: ``incremental_from``, the step its save references
    (the newest of ``earlier``; ``None``: saved in full) and ``incremental_chain``, the saves since
    the last full one (``info_of(step)`` gives an earlier step's): every ``full_every``-th is full."""
    if not earlier:
        return {"incremental_from": None, "incremental_chain": 0}
    base = max(earlier)
    chain = ((info_of(base) or {}).get("incremental_chain") or 0) + 1
    if full_every is not None and chain >= full_every:
        return {"incremental_from": None, "incremental_chain": 0}
    return {"incremental_from": base, "incremental_chain": chain}


def referenced_steps(location: Union[str, os.PathLike], info: Optional[dict[str, Any]] = None) -> set[int]:
    """The steps whose files the checkpoint at ``location`` (a ``step_N``) points into, read from
    its metadata unless its manager ``info`` says it was saved in full (a step saved before
    incremental saves existed has no ``incremental_from`` either); raises what reading it raises."""
    if info is not None and info.get("incremental_from") is None:
        return set()
    metadata, _ = load_checkpoint_metadata(location)
    names = {referenced_checkpoint(name) for name in metadata.files}
    return {step for step in map(parse_step_name, filter(None, names)) if step is not None}


def best_steps(metric_by_step: Mapping[int, float], keep_best: int, mode: str) -> set[int]:
    """The ``keep_best`` steps with the lowest (``mode="min"``) or highest (``"max"``) metric; ties go
    to the newer step.  Steps without a value are not in ``metric_by_step``."""
    ranked = sorted(metric_by_step.items(), key=lambda kv: (kv[1] if mode == "min" else -kv[1], -kv[0]))
    return {step for step, _ in ranked[:keep_best]}


def steps_to_delete(complete: Sequence[int], *, keep_last: Optional[int], keep_every: Optional[int] = None,
                    best: frozenset[int] = frozenset(), protected: frozenset[int] = frozenset(),
                    references: Optional[Mapping[int, Iterable[int]]] = None) -> list[int]:
    """The complete steps retention deletes, ascending, of ``complete`` (any order); ``best``: the
    steps kept for their metric; ``references``: step → the steps it points into (kept with it)."""
    steps = sorted(set(complete))
    if not steps or keep_last is None:
        return []
    keep = set(steps[-keep_last:]) | {steps[-1]} | set(best) | set(protected)
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    todo = list(keep)
    while references and todo:
        for referenced in references.get(todo.pop(), ()):
            if referenced not in keep:
                keep.add(referenced)
                todo.append(referenced)
    return [s for s in steps if s not in keep]
