"""``hp-dcp inspect`` and ``verify``: what a checkpoint holds, where, whether it is complete, and
every recorded checksum (a torch.distributed.checkpoint directory records none: completeness only).
Exports :func:`describe_checkpoint` (the ``--json`` document), ``run`` and ``run_verify``."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from hyper_parallel_dcp.core.metadata import MetadataIndex, TensorStorageMetadata, dtype_name, referenced_checkpoint
from hyper_parallel_dcp.storage_fs import is_torch_dcp_checkpoint
from hyper_parallel_dcp.storage_fs.integrity import check_complete, verify_checkpoint

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json, print_table, progress_bar

__all__ = ["describe_checkpoint", "run", "run_verify"]

_RANK_FILE = re.compile(r"^(?:_rank(\d+)_\.|__(\d+)_\d+\.distcp$)")


def describe_checkpoint(path: Path, *, with_chunks: bool = False) -> dict[str, Any]:
    """The ``inspect --json`` document of the checkpoint at ``path``: SPEC §9's keys, then ``path``,
    ``problems``, ``files``, ``ranks``, ``own_bytes`` and ``referenced_bytes`` (SPEC §14);
    ``with_chunks`` adds each tensor's ``chunk_list``.  Never raises for a bad checkpoint."""
    report = check_complete(path)
    doc: dict[str, Any] = {"complete": report.complete, "format": report.format,
                           "format_version": report.format_version, "tensors": {}, "objects": [], "path": str(path),
                           "problems": list(report.problems), "files": {}, "ranks": []}
    md = report.metadata
    if md is None:
        return doc
    storage = md.storage_data or {}
    for fqn in sorted(md.state_dict_metadata):
        entry = md.state_dict_metadata[fqn]
        if not isinstance(entry, TensorStorageMetadata):
            doc["objects"].append(fqn)
            if fqn in md.rank_objects:  # rank-local state: one copy per saving rank
                doc.setdefault("rank_local_objects", {})[fqn] = sorted(md.rank_objects[fqn])
            continue
        itemsize = entry.properties.dtype.itemsize
        tensor: dict[str, Any] = {"shape": list(entry.size), "dtype": dtype_name(entry.properties.dtype),
                                  "chunks": len(entry.chunks),
                                  "bytes": sum(math.prod(c.sizes) for c in entry.chunks) * itemsize}
        if with_chunks:
            infos = [(c, storage.get(MetadataIndex(fqn, c.offsets))) for c in entry.chunks]
            tensor["chunk_list"] = [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                                     "file": info.relative_path if info else None,
                                     "byte_offset": info.offset if info else None,
                                     "checksum": info.checksum if info else None} for c, info in infos]
        doc["tensors"][fqn] = tensor
    for name in sorted(md.files):
        m = _RANK_FILE.match(name)
        doc["files"][name] = {"bytes": md.files[name], "rank": int(m.group(1) or m.group(2)) if m else None}
    for rank in sorted({f["rank"] for f in doc["files"].values() if f["rank"] is not None}):
        names = [name for name, f in doc["files"].items() if f["rank"] == rank]
        doc["ranks"].append({"rank": rank, "files": names, "bytes": sum(md.files[n] for n in names)})
    doc["own_bytes"] = sum(size for name, size in md.files.items() if referenced_checkpoint(name) is None)
    referenced: Counter[str] = Counter()
    for info in storage.values():
        if (base := referenced_checkpoint(info.relative_path)) is not None:
            referenced[base] += info.length
    doc["referenced_bytes"] = dict(sorted(referenced.items()))
    return doc


def _print_human(doc: dict[str, Any], with_chunks: bool) -> None:
    tensors = doc["tensors"]
    print(f"checkpoint      {doc['path']}")
    if doc["format"] == "torch-dcp":
        print("format          torch.distributed.checkpoint (pickled .metadata, .distcp files)")
    else:
        print(f"format version  {doc['format_version'] if doc['format_version'] is not None else 'unknown'}")
    print(f"complete        {'yes' if doc['complete'] else 'NO'}")
    for problem in doc["problems"]:
        print(f"  - {problem}")
    print(f"tensors         {len(tensors)} ({format_bytes(sum(t['bytes'] for t in tensors.values()))} in "
          f"{sum(t['chunks'] for t in tensors.values())} chunks)")
    print(f"objects         {len(doc['objects'])}")
    print(f"files           {len(doc['files'])} ({format_bytes(sum(f['bytes'] for f in doc['files'].values()))})")
    if doc.get("referenced_bytes"):
        print(f"own bytes       {format_bytes(doc['own_bytes'])}; referenced (incremental): " + ", ".join(
            f"{format_bytes(n)} in {base}" for base, n in doc["referenced_bytes"].items()))
    if tensors:
        print()
        print_table(["FQN", "shape", "dtype", "chunks", "bytes"],
                    [[fqn, str(t["shape"]), t["dtype"], t["chunks"], t["bytes"]]
                     for fqn, t in tensors.items()], right=(3, 4))
        if with_chunks:
            for fqn, t in tensors.items():
                print(f"\n{fqn}")
                print_table(["offsets", "sizes", "file", "byte offset", "xxh3"],
                            [[c["offsets"], c["sizes"], c["file"], c["byte_offset"], c["checksum"]]
                             for c in t["chunk_list"]], right=(3,))
    if doc["objects"]:
        print(f"\nobjects ({len(doc['objects'])}):")
        for fqn in doc["objects"]:
            print(f"  {fqn}")
    if doc["ranks"]:
        print()
        print_table(["rank", "files", "bytes", "size"],
                    [[r["rank"], len(r["files"]), r["bytes"], format_bytes(r["bytes"])] for r in doc["ranks"]],
                    right=(0, 1, 2, 3))


def run(args: Any) -> int:
    """Print the description; exit 1 when the checkpoint is not complete."""
    path = existing_dir(args.checkpoint)
    doc = describe_checkpoint(path, with_chunks=args.chunks)
    if args.json:
        print_json(doc)
    else:
        _print_human(doc, args.chunks)
    return EXIT_OK if doc["complete"] else EXIT_PROBLEM


def _verify(path: Any, show_progress: bool) -> Any:
    """``verify_checkpoint(path)`` with a byte-count progress bar."""
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


def run_verify(args: Any) -> int:
    """Verify the checkpoint; exit 1 when it is incomplete or any checksum differs."""
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
