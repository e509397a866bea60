"""The ``incremental`` section (SPEC §14, issue 59): a save of a model whose base is frozen and
2 % of whose bytes changed, incremental (``save(..., incremental_from=...)``) beside full.

One process, the ``dense`` bf16 model of the preset's broadcast size (and, labelled, of
``large_mib`` when given); each save is fsynced.  Measured: the seconds of a full save, of
an incremental one from it, and of a full save of the changed tensors alone (the same
bytes written, no hashing: the per-save floor of fsyncs and metadata that every save
pays), the bytes the incremental save put into its own directory (data files, headers
and ``.metadata``) against the changed bytes, and a bit-exact load of the incremental
checkpoint.  Exports :func:`run_incremental` and :func:`incremental_goals` (``report``
renders the section).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["incremental_goals", "run_incremental"]

#: the share of the model's bytes that changes between the two saves
CHANGED_SHARE = 0.02


def _own_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _measure(root: Path, mib: float, reps: int) -> dict[str, Any]:
    import hyper_parallel_dcp as dcp

    from .report import summarize
    from .state_dicts import dense_shapes, make_state_dict

    base = make_state_dict(dense_shapes(mib))
    total = sum(t.numel() * t.element_size() for t in base.values())
    changed_sd, only_changed, changed = dict(base), {}, 0
    for fqn in sorted(base, key=lambda k: base[k].numel()):  # the smallest tensors first: adapters, norms
        if changed + base[fqn].numel() * base[fqn].element_size() > CHANGED_SHARE * total:
            continue
        changed_sd[fqn] = only_changed[fqn] = base[fqn] + 1  # every element's bits change
        changed += base[fqn].numel() * base[fqn].element_size()
    full, incremental, alone = root / "step_1", root / "step_2", root / "changed_only"
    times: dict[str, list[float]] = {"full": [], "incremental": [], "changed_only": []}
    written = 0
    for _ in range(reps):
        for path in (full, incremental, alone):
            shutil.rmtree(path, ignore_errors=True)
        for key, sd, path, kwargs in (("full", base, full, {}),
                                      ("incremental", changed_sd, incremental, {"incremental_from": full}),
                                      ("changed_only", only_changed, alone, {})):
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=path, no_dist=True, **kwargs)
            times[key].append(time.perf_counter() - t0)
        written = _own_bytes(incremental)
    target = {k: torch.empty_like(v) for k, v in base.items()}
    dcp.load(target, checkpoint_id=incremental, no_dist=True)
    exact = all(torch.equal(target[k], v) for k, v in changed_sd.items())
    shutil.rmtree(root, ignore_errors=True)
    summary = {k: summarize(v) for k, v in times.items()}
    full_s = summary["full"]["median"]
    return {"mib": mib, "summary": summary, "total_bytes": total, "changed_bytes": changed, "written_bytes": written,
            "time_ratio": summary["incremental"]["median"] / full_s,
            "floor_ratio": summary["changed_only"]["median"] / full_s,
            "written_over_changed": written / changed, "bit_exact": exact}


def _describe(inc: dict[str, Any]) -> str:
    s = inc["summary"]
    return (f"full save {s['full']['median']:.3f}s, incremental {s['incremental']['median']:.3f}s "
            f"({inc['time_ratio']:.3f}x; a full save of the changed tensors alone {inc['floor_ratio']:.3f}x), "
            f"wrote {inc['written_bytes']} B for {inc['changed_bytes']} changed of {inc['total_bytes']} "
            f"({inc['written_over_changed']:.3f}x the changed bytes), load bit-exact: {inc['bit_exact']}")


def run_incremental(root: Path, mib: float, reps: int, log: Callable[[str], None],
                    large_mib: Optional[float] = None) -> dict[str, Any]:
    """Full and incremental saves of the frozen-base model under ``root``, ``reps`` times each;
    with ``large_mib``, the same at that size too, as ``out["large"]``."""
    torch.set_num_threads(1)
    out = _measure(root, mib, reps)
    log(f"incremental: {_describe(out)}")
    if large_mib:
        out["large"] = _measure(root, large_mib, reps)
        log(f"incremental, {large_mib:g} MiB row: {_describe(out['large'])}")
    return out


def incremental_goals(inc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 59's goals for this section, as ``report.evaluate_goals`` states goals (the
    ``large`` row, when measured, as a labelled goal of its own)."""
    goals = [
        {"goal": "incremental save of a frozen base + 2 % changed: bytes written <= 1.05x the changed bytes",
         "measured": f"{inc['written_over_changed']:.3f}x", "value": inc["written_over_changed"], "limit": 1.05,
         "met": inc["written_over_changed"] <= 1.05 and inc["bit_exact"]}]
    for row, label in ((inc, ""), (inc.get("large"), " ({mib:g} MiB row)")):
        if row:
            goals.append({"goal": "incremental save time <= 0.1x a full save" + label.format(mib=row["mib"]),
                          "measured": f"{row['time_ratio']:.3f}x (the floor, a save of the changed bytes alone: "
                                      f"{row['floor_ratio']:.3f}x)",
                          "value": row["time_ratio"], "limit": 0.1, "met": row["time_ratio"] <= 0.1})
    return goals

