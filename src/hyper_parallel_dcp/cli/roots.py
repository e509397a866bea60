"""The ``hp-dcp`` commands over a root of step directories: ``latest``, ``ls`` and ``clean``.
Exports the three ``run_*`` functions and :func:`format_age`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hyper_parallel_dcp.step_storage import step_storage_for

from ._common import (
    CLEAN_GRACE_S,
    EXIT_OK,
    EXIT_PROBLEM,
    UsageError,
    existing_dir,
    format_bytes,
    print_json,
    print_table,
)

__all__ = ["format_age", "run_clean", "run_latest", "run_ls"]


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


def _leftover_json(item: Any, with_bytes: bool = True) -> dict[str, Any]:
    doc = {"step": item.step, "kind": item.kind, "path": item.location}
    return {**doc, "bytes": item.bytes} if with_bytes else doc


def _full_check(child: Any) -> bool:
    # only for a torch DCP pickle or {rank}.metadata files: check_complete parses them (torch)
    from hyper_parallel_dcp.storage_fs.integrity import check_complete

    return check_complete(child).complete


def run_latest(args: Any) -> int:
    """Print the newest complete checkpoint's path (exit 0), or say that none is (exit 1).
    Complete: its ``.metadata`` is JSON of a known format version (``metadata_complete``),
    decided without torch, so the command starts in about 0.1 s."""
    from hyper_parallel_dcp.storage_fs.latest import metadata_complete, newest_checkpoint

    root = existing_dir(args.root, "checkpoint root")
    latest = newest_checkpoint(root, lambda child: metadata_complete(child, _full_check))
    if args.json:
        print_json({"root": str(root), "latest": str(latest) if latest is not None else None})
    elif latest is not None:
        print(latest)
    else:
        print(f"no complete checkpoint under {root} (looked for subdirectories whose names end in a step number)",
              file=sys.stderr)
    return EXIT_OK if latest is not None else EXIT_PROBLEM


def _root_steps(args: Any) -> tuple[Any, Any]:
    """The root of ``ls``/``clean`` and its step storage; :class:`UsageError` for a bad root or ``--grace``."""
    root = existing_dir(args.root, "checkpoint root")
    if args.grace < 0:
        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    return root, step_storage_for(root)


def run_ls(args: Any) -> int:
    """List the steps and the leftovers that ``clean`` would remove (exit 0); changes nothing."""
    root, steps = _root_steps(args)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for entry in steps.list_steps():
        info = steps.read_info(entry.step) or {}
        saved_at = steps.saved_at(entry.step)
        rows.append({"step": entry.step, "path": entry.location, "complete": entry.complete,
                     "bytes": steps.size_bytes(entry.step), "saved_at": saved_at,
                     "age_s": None if saved_at is None else round(now - saved_at, 3),
                     "metrics": info.get("metrics") if isinstance(info.get("metrics"), dict) else {}})
    complete = [r["step"] for r in rows if r["complete"]]
    latest = complete[-1] if complete else None
    # what clean removes: leftovers of dead saves not touched for --grace, of steps whose
    # save lock nobody holds (probing a lock changes nothing)
    leftovers = steps.find_leftovers(older_than=latest, grace=args.grace)
    local = {d: _local_rows(d) for d in args.local}
    if args.json:
        print_json({"root": str(root), "latest": latest, "steps": rows,
                    "leftovers": [_leftover_json(x) for x in leftovers], **({"local": local} if local else {})})
        return EXIT_OK
    if not rows:
        print(f"{root}: no step_N directories")
    else:
        print_table(["step", "complete", "size", "age", "metrics"],
                    [(r["step"], "yes" if r["complete"] else "NO", format_bytes(r["bytes"]),
                      "" if r["age_s"] is None else format_age(r["age_s"]),
                      " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(r["metrics"].items())))
                     for r in rows], right=(0, 2, 3))
        print(f"\n{len(complete)} complete of {len(rows)}; latest complete: "
              f"{'none' if latest is None else f'step {latest}'}")
    if leftovers:
        grace = "" if args.grace == CLEAN_GRACE_S else f" --grace {args.grace:g}"
        print(f"{len(leftovers)} leftover(s) of dead saves ({format_bytes(sum(x.bytes for x in leftovers))}): "
              f"'hp-dcp clean {root}{grace}' removes them")
    for directory, local_rows in local.items():
        print(f"\nlocal tier {directory}:")
        print_table(["step", "committed copies of ranks", "size"],
                    [(r["step"], ",".join(map(str, r["ranks"])) or "none", format_bytes(r["bytes"]))
                     for r in local_rows], right=(0, 2))
    return EXIT_OK


def _local_rows(directory: str) -> list[dict[str, Any]]:
    """The steps of a node-local tier directory: the ranks whose copies are committed there, bytes."""
    from pathlib import Path

    from hyper_parallel_dcp.local_copies import LocalCopies

    existing_dir(directory, "local tier directory")
    return [{"step": step, "ranks": sorted(records), "bytes": sum(sum(r.get("files", {}).values())
                                                                  for r in records.values())}
            for step, records in sorted(LocalCopies(Path(directory), -1).markers().items())]


def run_clean(args: Any) -> int:
    """Remove (with ``--dry-run``: list) the leftovers of dead saves; exit 1 when one is in use."""
    root, steps = _root_steps(args)
    complete = [e.step for e in steps.list_steps() if e.complete]
    newest = complete[-1] if complete else None
    removed: list[Any] = []
    kept: list[Any] = []
    for item in steps.find_leftovers(older_than=newest, grace=args.grace):
        (removed if args.dry_run or steps.remove_leftover(item) else kept).append(item)
    total = sum(x.bytes for x in removed)
    if args.json:
        print_json({"root": str(root), "dry_run": bool(args.dry_run), "removed": [_leftover_json(x) for x in removed],
                    "in_use": [_leftover_json(x, with_bytes=False) for x in kept], "bytes": total})
        return EXIT_PROBLEM if kept else EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for x in removed:
        what = f"{len(x.paths)} file(s) in " if x.kind == "mailbox" else ""
        print(f"{verb} {x.kind:<10} {format_bytes(x.bytes):>10}  {what}{x.location}")
    for x in kept:
        print(f"in use, left {x.kind:<10} {x.location}")
    print(f"{verb} {len(removed)} leftover(s), {format_bytes(total)}"
          + ("" if newest is not None else "; no complete step, so incomplete step directories were kept"))
    return EXIT_PROBLEM if kept else EXIT_OK
