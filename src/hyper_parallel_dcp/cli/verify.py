"""``hp-dcp verify``: completeness and every recorded checksum (``storage_fs.integrity``)."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json, progress_bar

__all__ = ["run"]


def run(args: Any) -> int:
    """Verify the checkpoint; exit 1 when it is incomplete or any checksum differs."""
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    path = existing_dir(args.checkpoint)
    bar = progress_bar(not args.json, total=0, unit="B", unit_scale=True, unit_divisor=1024, desc="verify")

    def advance(done: int, total: int) -> None:
        if bar is not None:
            bar.total, bar.n = total, done
            bar.refresh()

    try:
        report = verify_checkpoint(path, progress=advance)
    finally:
        if bar is not None:
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
