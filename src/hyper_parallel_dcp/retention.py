"""Which complete checkpoints a :class:`CheckpointManager` keeps: a pure function of step numbers.

Kept, the union of: the newest ``keep_last`` complete steps (all with ``None``), every multiple
of ``keep_every``, the best ``keep_best`` by a metric, the newest complete step and every
``protected`` step (being written or read).  Everything else that is complete is deleted.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

__all__ = ["best_steps", "steps_to_delete"]


def best_steps(metric_by_step: Mapping[int, float], keep_best: int, mode: str) -> set[int]:
    """The ``keep_best`` steps with the lowest (``mode="min"``) or highest (``"max"``) metric; ties go
    to the newer step.  Steps without a value are not in ``metric_by_step``."""
    ranked = sorted(metric_by_step.items(), key=lambda kv: (kv[1] if mode == "min" else -kv[1], -kv[0]))
    return {step for step, _ in ranked[:keep_best]}


def steps_to_delete(complete: Sequence[int], *, keep_last: Optional[int], keep_every: Optional[int] = None,
                    best: frozenset[int] = frozenset(), protected: frozenset[int] = frozenset()) -> list[int]:
    """The complete steps retention deletes, ascending, of ``complete`` (any order); ``best``: the
    steps kept for their metric."""
    steps = sorted(set(complete))
    if not steps or keep_last is None:
        return []
    keep = set(steps[-keep_last:]) | {steps[-1]} | set(best) | set(protected)
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]
