"""``hp-dcp verify``: completeness and every recorded checksum (``storage_fs.integrity``); a
torch.distributed.checkpoint directory records none, and is checked for completeness only."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json, progress_bar

__all__ = ["run"]


def _verify(path: Any, show_progress: bool) -> Any:
    """``verify_checkpoint(path)`` with a byte-count progress bar."""
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    bar = progress_bar(show_progress, total=0, unit="B", unit_scale=True, unit_divisor=1024, desc="verify")

    def advance(done: int, total: int) -> None:
        if bar is not None:
            bar.total, bar.n = total, done
            bar.refresh()

    try:
        return verify_checkpoint(path, progress=advance)
    finally:
        if bar is not None:
            bar.close()


def run(args: Any) -> int:
    """Verify the checkpoint; exit 1 when it is incomplete or any checksum differs."""
    from hyper_parallel_dcp.storage_fs import is_torch_dcp_checkpoint
    from hyper_parallel_dcp.storage_fs.integrity import check_complete

    path = existing_dir(args.checkpoint)
    if not isinstance(path, str) and is_torch_dcp_checkpoint(path):  # no checksums: completeness only
        report = check_complete(path)
        ok, counts = report.complete, {"format": "torch-dcp", "chunks_checked": 0, "bytes_checked": 0}
        summary = ("a torch.distributed.checkpoint checkpoint, complete; it records no checksums, so there are "
                   "none to check" if ok else "a torch.distributed.checkpoint checkpoint, not complete")
    else:
        report = _verify(path, not args.json)
        ok, counts = report.ok, {"chunks_checked": report.chunks_checked, "bytes_checked": report.bytes_checked}
        summary = f"{report.chunks_checked} items, {format_bytes(report.bytes_checked)} checked"
    if args.json:
        print_json({"path": str(report.path), "ok": ok, **counts, "problems": report.problems})
    else:
        print(f"{'OK' if ok else 'FAILED'}: {report.path}: {summary}")
        for problem in report.problems:
            print(f"  - {problem}")
    return EXIT_OK if ok else EXIT_PROBLEM
