"""``hp-dcp clean``: remove what saves that died left under a ``CheckpointManager`` root."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json

__all__ = ["run"]


def run(args: Any) -> int:
    """Remove (or with ``--dry-run`` list) the leftovers; exit 1 when one could not be removed."""
    from hyper_parallel_dcp.step_storage import step_storage_for

    root = existing_dir(args.root, "checkpoint root")
    if args.grace < 0:
        from ._common import UsageError

        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    steps = step_storage_for(root)
    complete = [e.step for e in steps.list_steps() if e.complete]
    newest = complete[-1] if complete else None
    found = steps.find_leftovers(older_than=newest, grace=args.grace)
    removed, kept = [], []
    for item in found:
        if args.dry_run or steps.remove_leftover(item):
            removed.append(item)
        else:
            kept.append(item)
    if args.json:
        print_json({
            "root": str(root),
            "dry_run": bool(args.dry_run),
            "removed": [{"step": x.step, "kind": x.kind, "path": x.location, "bytes": x.bytes} for x in removed],
            "in_use": [{"step": x.step, "kind": x.kind, "path": x.location} for x in kept],
            "bytes": sum(x.bytes for x in removed),
        })
    else:
        verb = "would remove" if args.dry_run else "removed"
        for x in removed:
            what = f"{len(x.paths)} file(s) in " if x.kind == "mailbox" else ""
            print(f"{verb} {x.kind:<10} {format_bytes(x.bytes):>10}  {what}{x.location}")
        for x in kept:
            print(f"in use, left {x.kind:<10} {x.location}")
        print(f"{verb} {len(removed)} leftover(s), {format_bytes(sum(x.bytes for x in removed))}"
              + ("" if newest is not None else "; no complete step, so incomplete step directories were kept"))
    return EXIT_PROBLEM if kept else EXIT_OK
