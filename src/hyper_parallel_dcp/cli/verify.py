"""``hp-dcp verify``: completeness and every recorded checksum (``storage_fs.integrity``).

A torch.distributed.checkpoint directory records no checksums: it is checked for
completeness only, and said so in one line.
"""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json, progress_bar

__all__ = ["run"]


def _run_torch_dcp(path: Any, as_json: bool) -> int:
    """Completeness of a torch DCP checkpoint (its files and byte ranges); no checksums to check."""
    from hyper_parallel_dcp.storage_fs.integrity import check_complete

    report = check_complete(path)
    if as_json:
        print_json({"path": str(report.path), "ok": report.complete, "format": "torch-dcp", "chunks_checked": 0,
                    "bytes_checked": 0, "problems": report.problems})
    elif report.complete:
        print(f"OK: {report.path}: a torch.distributed.checkpoint checkpoint, complete; it records no checksums, "
              "so there are none to check")
    else:
        print(f"FAILED: {report.path}: a torch.distributed.checkpoint checkpoint, not complete")
        for problem in report.problems:
            print(f"  - {problem}")
    return EXIT_OK if report.complete else EXIT_PROBLEM


def run(args: Any) -> int:
    """Verify the checkpoint; exit 1 when it is incomplete or any checksum differs."""
    from hyper_parallel_dcp.storage_fs import is_torch_dcp_checkpoint
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    path = existing_dir(args.checkpoint)
    if not isinstance(path, str) and is_torch_dcp_checkpoint(path):
        return _run_torch_dcp(path, args.json)
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
