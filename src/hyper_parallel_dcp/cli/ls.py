"""``hp-dcp ls``: every step of a ``CheckpointManager`` root, complete or not, with size, age and metrics."""

from __future__ import annotations

import time
from typing import Any

from ._common import EXIT_OK, existing_dir, format_bytes, print_json, print_table

__all__ = ["format_age", "run"]


def format_age(seconds: float) -> str:
    """A short age: ``42s``, ``3m12s``, ``2h05m``, ``4d03h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _metrics_text(metrics: Any) -> str:
    if not isinstance(metrics, dict) or not metrics:
        return ""
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items()))


def run(args: Any) -> int:
    """List the steps (exit 0); a root that is not a directory is a usage error."""
    from hyper_parallel_dcp.step_storage import step_storage_for

    root = existing_dir(args.root, "checkpoint root")
    steps = step_storage_for(root)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for entry in steps.list_steps():
        info = steps.read_info(entry.step) or {}
        saved_at = steps.saved_at(entry.step)
        rows.append({
            "step": entry.step,
            "path": entry.location,
            "complete": entry.complete,
            "bytes": steps.size_bytes(entry.step),
            "saved_at": saved_at,
            "age_s": None if saved_at is None else round(now - saved_at, 3),
            "metrics": info.get("metrics") if isinstance(info.get("metrics"), dict) else {},
        })
    complete = [r["step"] for r in rows if r["complete"]]
    latest = complete[-1] if complete else None
    # Listed without probing the save locks (ls changes nothing): a running save shows here too.
    leftovers = steps.find_leftovers(older_than=latest, check_running=False)
    if args.json:
        print_json({
            "root": str(root),
            "latest": latest,
            "steps": rows,
            "leftovers": [{"step": x.step, "kind": x.kind, "path": x.location, "bytes": x.bytes} for x in leftovers],
        })
        return EXIT_OK
    if not rows:
        print(f"{root}: no step_N directories")
    else:
        print_table(["step", "complete", "size", "age", "metrics"],
                    [(r["step"], "yes" if r["complete"] else "NO", format_bytes(r["bytes"]),
                      "" if r["age_s"] is None else format_age(r["age_s"]), _metrics_text(r["metrics"]))
                     for r in rows], right=(0, 2, 3))
        print(f"\n{len(complete)} complete of {len(rows)}; latest complete: "
              f"{'none' if latest is None else f'step {latest}'}")
    if leftovers:
        total = sum(x.bytes for x in leftovers)
        print(f"{len(leftovers)} leftover(s) of interrupted saves ({format_bytes(total)}), unless a save is "
              f"running now: 'hp-dcp clean {root}' removes those of dead saves")
    return EXIT_OK
