"""A/B timing of the async benchmark rows at a reduced size, for interleaved runs.

``python ab_async.py dense|small [--world 2] [--mib 64] [--count 500] [--kib 128]``
prints one JSON line: per figure, the slowest rank's median over the saves timed.
Figures: ``clone`` (a fresh host copy of every local tensor: the first-save floor),
``copy_into`` (a copy into preallocated buffers: the later-save floor), ``first_blocking``
/ ``first_landed`` (each by a new writer started ahead and ready, the plan cache cleared,
as io_bench times them), ``later_blocking`` / ``later_landed``.  It uses only the public
API, so the same file runs against the baseline checkout's venv and this one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.async_persist import shutdown_writer, start_writer
    from hyper_parallel_dcp.benchmarks.state_dicts import dense_shapes, local_tensors, make_state_dict, small_shapes
    from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    shapes = dense_shapes(cfg["mib"]) if cfg["case"] == "dense" else small_shapes(cfg["count"], cfg["kib"])
    sd = make_state_dict(shapes, mesh=mesh)
    sd["step"] = 3
    tensors = local_tensors(sd)
    prealloc = [torch.empty_like(t) for t in tensors]
    out: dict[str, list[float]] = {k: [] for k in ("clone", "copy_into", "first_blocking", "first_landed",
                                                    "later_blocking", "later_landed")}
    for _ in range(3):
        t0 = time.perf_counter()
        copies = [t.clone() for t in tensors]
        out["clone"].append(time.perf_counter() - t0)
        del copies
        t0 = time.perf_counter()
        torch._foreach_copy_(prealloc, tensors)
        out["copy_into"].append(time.perf_counter() - t0)
    root = Path(cfg["root"])
    for i in range(cfg["first"] + cfg["later"]):
        first = i < cfg["first"]
        if first:
            shutdown_writer()
            StandardSavePlanner.clear_cache()
        start_writer(wait=True, timeout=600)
        path = root / f"s{i}"
        dist.barrier()
        t0 = time.perf_counter()
        resp = hp.async_save(sd, checkpoint_id=path)
        blocking = time.perf_counter() - t0
        resp.get_result(600)
        landed = time.perf_counter() - t0
        kind = "first" if first else "later"
        out[f"{kind}_blocking"].append(blocking)
        out[f"{kind}_landed"].append(landed)
        sd["step"] += 1
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    shutdown_writer()
    return {k: _median(v) for k, v in out.items()}


def main() -> None:
    from hyper_parallel_dcp.core.testing import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["dense", "small"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--kib", type=float, default=128)
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--later", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hp-dcp-ab-") as root:
        cfg = dict(vars(args), root=root)
        per_rank = run_distributed(worker, args.world, cfg, timeout=900)
    print(json.dumps({k: max(r[k] for r in per_rank) for k in per_rank[0]}))


if __name__ == "__main__":
    main()
