"""``hp-dcp latest``: the newest complete checkpoint under a root of step directories."""

from __future__ import annotations

import sys
from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, print_json

__all__ = ["run"]


def run(args: Any) -> int:
    """Print the path (exit 0), or say that none is complete (exit 1)."""
    from hyper_parallel_dcp.storage_fs.integrity import find_latest_checkpoint

    root = existing_dir(args.root, "checkpoint root")
    latest = find_latest_checkpoint(root)
    if args.json:
        print_json({"root": str(root), "latest": str(latest) if latest is not None else None})
    elif latest is not None:
        print(latest)
    else:
        print(f"no complete checkpoint under {root} (looked for subdirectories whose names end in a step number)",
              file=sys.stderr)
    return EXIT_OK if latest is not None else EXIT_PROBLEM
