"""Cost of checksum verification on load (FileSystemReader(verify=True) vs verify=False).

Saves a checkpoint of ``--mib`` MiB (float32 chunks of ``--chunk-mib`` MiB each), then
times loads of (a) every chunk whole and (b) the first half of every chunk's rows (a
resharded load: the whole chunk must still be hashed).  Each is measured with the files
in the page cache ("hot") and evicted with posix_fadvise(DONTNEED) ("cold", as far as
the kernel honours it).  Prints the median of ``--repeat`` runs.

    python packages/dcp-storage-fs/benchmarks/bench_verify.py --mib 512
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.pipeline import save_state_dict
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter


def evict(root: Path) -> None:
    for file in root.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_once(root: Path, verify: bool, half: bool, targets: dict[str, torch.Tensor]) -> float:
    reader = FileSystemReader(root, verify=verify)
    md = reader.load_metadata()
    reader.set_up_storage_reader(md, is_coordinator=True)
    items = []
    for fqn, target in targets.items():
        rows = target.shape[0] // 2 if half else target.shape[0]
        idx = MetadataIndex(fqn, (0, 0))
        items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, (0, 0)), (0, 0), idx, (0, 0),
                              (rows, target.shape[1])))
    start = time.perf_counter()
    for item in reader.sort_items(items):
        reader.read_into(item, targets[item.dest_index.fqn][: item.lengths[0]])
    elapsed = time.perf_counter() - start
    reader.reset()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cols = 1024
    rows = args.chunk_mib * 1024 * 1024 // (4 * cols)
    n = args.mib // args.chunk_mib
    state = {f"w{i:04d}": torch.randn(rows, cols) for i in range(n)}
    tmp = Path(tempfile.mkdtemp(prefix="hp-dcp-bench-", dir=args.dir))
    try:
        root = tmp / "ckpt"
        save_state_dict(state, FileSystemWriter(root), no_dist=True)
        targets = {k: torch.empty_like(v) for k, v in state.items()}
        for half in (False, True):
            for cache in ("hot", "cold"):
                times = {}
                for verify in (False, True):
                    runs = []
                    for _ in range(args.repeat):
                        if cache == "cold":
                            evict(root)
                        else:
                            load_once(root, False, half, targets)
                        runs.append(load_once(root, verify, half, targets))
                    times[verify] = statistics.median(runs)
                cost = (times[True] - times[False]) / times[False] * 100
                what = "half of each chunk" if half else "whole chunks"
                print(f"{args.mib} MiB, {what:18s} {cache}: verify off {times[False]*1e3:8.1f} ms, "
                      f"on {times[True]*1e3:8.1f} ms, cost {cost:+6.1f} %")
        for k, v in state.items():
            assert torch.equal(targets[k], v), k
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
