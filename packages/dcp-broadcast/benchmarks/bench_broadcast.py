"""Benchmark of read-once + broadcast on CPU gloo ranks.

Two measurements, side by side in one run:

1. Replicated state dict (replication factor R = number of ranks): bytes read from
   storage and load time with broadcast off and on, through a reader throttled to one
   shared bandwidth (a stand-in for shared storage / NFS: a lock file serialises the
   "transfers" of all ranks, each taking nbytes / bandwidth).
2. ~2000 small replicated shards: the broadcast phase (main-thread time launching and
   waiting for broadcasts, slowest rank) with one broadcast per shard vs batched.

Run:  python packages/dcp-broadcast/benchmarks/bench_broadcast.py [--ranks 2 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
import time

import torch

from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader

MiB = 1024 * 1024


class ThrottledReader(FileSystemReader):
    """A FileSystemReader whose reads share one bandwidth across all processes."""

    def __init__(self, path, lock_file, bytes_per_s):
        super().__init__(path)
        self.lock_file = lock_file
        self.bytes_per_s = bytes_per_s

    def _transfer(self, nbytes):
        with open(self.lock_file, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                time.sleep(nbytes / self.bytes_per_s)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read_into(self, item, dest):
        before = self.bytes_read
        super().read_into(item, dest)
        self._transfer(self.bytes_read - before)


def _replicated(n_tensors, tensor_bytes):
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i:03d}.weight": torch.randn(tensor_bytes // 4, generator=g) for i in range(n_tensors)}


def _throttled_worker(rank, world_size, path, lock_file, bytes_per_s, n_tensors, tensor_bytes):
    import torch.distributed as dist

    from hyper_parallel_dcp.api import load

    ref = _replicated(n_tensors, tensor_bytes)
    out = {}
    for name, flag in (("off", False), ("on", True)):
        sd = {k: torch.zeros_like(v) for k, v in ref.items()}
        reader = ThrottledReader(path, lock_file, bytes_per_s)
        dist.barrier()
        start = time.perf_counter()
        load(sd, storage_reader=reader, broadcast_replicated_tensors=flag)
        elapsed = time.perf_counter() - start
        ok = all(torch.equal(sd[k], ref[k]) for k in ref)
        out[name] = {"seconds": elapsed, "bytes_read": reader.bytes_read, "ok": ok}
    return out


def _small_worker(rank, world_size, path, n_shards, shard_bytes, repeats):
    import torch.distributed as dist

    from hyper_parallel_dcp.broadcast import make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    ref = _replicated(n_shards, shard_bytes)
    out = {}
    for name, batch in (("per_shard", 0), ("batched", 6 * MiB)):
        best = None
        for _ in range(repeats):
            sd = {k: torch.zeros_like(v) for k, v in ref.items()}
            ex = make_read_executor(batch_bytes=batch)
            dist.barrier()
            start = time.perf_counter()
            load_state_dict(sd, FileSystemReader(path), read_executor=ex)
            total = time.perf_counter() - start
            assert all(torch.equal(sd[k], ref[k]) for k in ref)
            run = {"broadcast_seconds": ex.stats.broadcast_seconds, "load_seconds": total,
                   "broadcasts": ex.stats.broadcasts}
            if best is None or run["broadcast_seconds"] < best["broadcast_seconds"]:
                best = run
        out[name] = best
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-mib", type=float, default=2.0)
    parser.add_argument("--bandwidth-mib", type=float, default=128.0, help="shared storage bandwidth, MiB/s")
    parser.add_argument("--small-shards", type=int, default=2000)
    parser.add_argument("--small-bytes", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from hyper_parallel_dcp.api import save

    results = {"throttled": {}, "small_shards": {}}
    with tempfile.TemporaryDirectory(prefix="hp-dcp-bench-") as tmp:
        big = os.path.join(tmp, "replicated")
        tensor_bytes = int(args.tensor_mib * MiB) // 4 * 4
        save(_replicated(args.tensors, tensor_bytes), checkpoint_id=big, no_dist=True)
        small = os.path.join(tmp, "small")
        save(_replicated(args.small_shards, args.small_bytes), checkpoint_id=small, no_dist=True)
        total = args.tensors * tensor_bytes
        print(f"replicated state dict: {args.tensors} x {tensor_bytes / MiB:.1f} MiB = {total / MiB:.1f} MiB, "
              f"shared bandwidth {args.bandwidth_mib:.0f} MiB/s")
        for world in args.ranks:
            lock = os.path.join(tmp, f"throttle-{world}.lock")
            per_rank = run_distributed(_throttled_worker, world, big, lock, args.bandwidth_mib * MiB,
                                       args.tensors, tensor_bytes, timeout=600)
            row = {}
            for name in ("off", "on"):
                row[name] = {
                    "seconds": max(r[name]["seconds"] for r in per_rank),
                    "bytes_read": sum(r[name]["bytes_read"] for r in per_rank),
                    "ok": all(r[name]["ok"] for r in per_rank),
                }
            row["speedup"] = row["off"]["seconds"] / row["on"]["seconds"]
            results["throttled"][world] = row
            print(f"  R={world}: bytes read off {row['off']['bytes_read'] / total:.2f}x, "
                  f"on {row['on']['bytes_read'] / total:.2f}x; load off {row['off']['seconds']:.3f} s, "
                  f"on {row['on']['seconds']:.3f} s, speedup {row['speedup']:.2f} "
                  f"(target >= {0.6 * world:.1f}); values ok: {row['off']['ok'] and row['on']['ok']}")
        print(f"small shards: {args.small_shards} x {args.small_bytes} B, replicated")
        for world in args.ranks:
            per_rank = run_distributed(_small_worker, world, small, args.small_shards, args.small_bytes,
                                       args.repeats, timeout=600)
            row = {name: {"broadcast_seconds": max(r[name]["broadcast_seconds"] for r in per_rank),
                          "load_seconds": max(r[name]["load_seconds"] for r in per_rank),
                          "broadcasts": max(r[name]["broadcasts"] for r in per_rank)}
                   for name in ("per_shard", "batched")}
            row["broadcast_speedup"] = row["per_shard"]["broadcast_seconds"] / row["batched"]["broadcast_seconds"]
            results["small_shards"][world] = row
            print(f"  {world} ranks: broadcast phase per shard {row['per_shard']['broadcast_seconds'] * 1e3:.1f} ms "
                  f"({row['per_shard']['broadcasts']} broadcasts), batched "
                  f"{row['batched']['broadcast_seconds'] * 1e3:.2f} ms ({row['batched']['broadcasts']}), "
                  f"{row['broadcast_speedup']:.1f}x; whole load {row['per_shard']['load_seconds']:.3f} s vs "
                  f"{row['batched']['load_seconds']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
