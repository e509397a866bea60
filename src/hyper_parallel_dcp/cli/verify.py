"""``hp-dcp verify``: completeness and every recorded checksum (the integrity API)."""

from __future__ import annotations

import sys
from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json

__all__ = ["run"]


class _ByteBar:
    """A tqdm bar fed by ``verify_checkpoint``'s ``progress(done, total)`` callback."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc="verify",
                            file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: Any) -> int:
    """Verify the checkpoint; exit 1 when it is incomplete or any checksum differs."""
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    path = existing_dir(args.checkpoint)
    bar = _ByteBar(not args.json)
    try:
        report = verify_checkpoint(path, progress=bar)
    finally:
        bar.close()
    if args.json:
        print_json({"path": str(report.path), "ok": report.ok, "chunks_checked": report.chunks_checked,
                    "bytes_checked": report.bytes_checked, "problems": report.problems})
    else:
        status = "OK" if report.ok else "FAILED"
        print(f"{status}: {report.path}: {report.chunks_checked} items, {format_bytes(report.bytes_checked)} checked")
        for problem in report.problems:
            print(f"  - {problem}")
    return EXIT_OK if report.ok else EXIT_PROBLEM
