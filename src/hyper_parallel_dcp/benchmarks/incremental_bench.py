"""The ``incremental`` section (SPEC §14, issue 59): a save of a model whose base is frozen and
2 % of whose bytes changed, incremental (``save(..., incremental_from=...)``) beside full.

One process, the ``dense`` bf16 model of the preset's broadcast size; each save is fsynced.
Measured: the seconds of a full save and of an incremental one from it, the bytes the
incremental save put into its own directory (data files, headers and ``.metadata``)
against the changed bytes, and a bit-exact load of the incremental checkpoint.
Exports :func:`run_incremental` and :func:`incremental_goals` (``report`` renders the section).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["incremental_goals", "run_incremental"]

#: the share of the model's bytes that changes between the two saves
CHANGED_SHARE = 0.02


def _own_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def run_incremental(root: Path, mib: float, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Full and incremental saves of the frozen-base model under ``root``, ``reps`` times each."""
    import hyper_parallel_dcp as dcp

    from .report import summarize
    from .state_dicts import dense_shapes, make_state_dict

    torch.set_num_threads(1)
    base = make_state_dict(dense_shapes(mib))
    total = sum(t.numel() * t.element_size() for t in base.values())
    changed_sd, changed = dict(base), 0
    for fqn in sorted(base, key=lambda k: base[k].numel()):  # the smallest tensors first: adapters, norms
        if changed + base[fqn].numel() * base[fqn].element_size() > CHANGED_SHARE * total:
            continue
        changed_sd[fqn] = base[fqn] + 1  # every element's bits change
        changed += base[fqn].numel() * base[fqn].element_size()
    full, incremental = root / "step_1", root / "step_2"
    times: dict[str, list[float]] = {"full": [], "incremental": []}
    written = 0
    for _ in range(reps):
        for path in (full, incremental):
            shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        dcp.save(base, checkpoint_id=full, no_dist=True)
        times["full"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.save(changed_sd, checkpoint_id=incremental, no_dist=True, incremental_from=full)
        times["incremental"].append(time.perf_counter() - t0)
        written = _own_bytes(incremental)
    target = {k: torch.empty_like(v) for k, v in base.items()}
    dcp.load(target, checkpoint_id=incremental, no_dist=True)
    exact = all(torch.equal(target[k], v) for k, v in changed_sd.items())
    shutil.rmtree(root, ignore_errors=True)
    summary = {k: summarize(v) for k, v in times.items()}
    out = {"summary": summary, "total_bytes": total, "changed_bytes": changed, "written_bytes": written,
           "time_ratio": summary["incremental"]["median"] / summary["full"]["median"],
           "written_over_changed": written / changed, "bit_exact": exact}
    log(f"incremental: full save {summary['full']['median']:.3f}s, incremental {summary['incremental']['median']:.3f}s "
        f"({out['time_ratio']:.3f}x), wrote {written} B for {changed} changed of {total} "
        f"({out['written_over_changed']:.3f}x the changed bytes), load bit-exact: {exact}")
    return out


def incremental_goals(inc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 59's goals for this section, as ``report.evaluate_goals`` states goals."""
    return [
        {"goal": "incremental save of a frozen base + 2 % changed: bytes written <= 1.05x the changed bytes",
         "measured": f"{inc['written_over_changed']:.3f}x", "value": inc["written_over_changed"], "limit": 1.05,
         "met": inc["written_over_changed"] <= 1.05 and inc["bit_exact"]},
        {"goal": "incremental save time <= 0.1x a full save", "measured": f"{inc['time_ratio']:.3f}x",
         "value": inc["time_ratio"], "limit": 0.1, "met": inc["time_ratio"] <= 0.1},
    ]
