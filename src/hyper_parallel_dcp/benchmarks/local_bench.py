"""The local tier section (SPEC §13): 4 ranks as 2 nodes, the persistent tier behind the
shared bandwidth cap of the broadcast section, node 1 lost.

Measured: recovery (a new manager → state restored) from the local tier, node 1's copies
received from their replicas, against the same restore from the persistent tier through
:class:`ThrottledFileSystemReader`; bytes read from the persistent tier during the local
recovery; the time a local save blocks training (staging) against a copy of the same
tensors into preallocated host memory.  Exports :func:`local_tier_worker`, :func:`local_lines`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["local_lines", "local_tier_worker"]


def _state(rank: int, mib: float, tensors: int = 8) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    numel = int(mib * 2**20 / 4 / tensors)  # every rank's own shards: keys no other rank has
    return {f"rank{rank}.layer{i}": torch.randn(numel, generator=gen) for i in range(tensors)}


def local_tier_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hyper_parallel_dcp import CheckpointManager, LocalTier, load
    from hyper_parallel_dcp.core.testing import FileReads

    from .throttle import SharedBandwidth, ThrottledFileSystemReader

    torch.set_num_threads(1)
    root, local_root = Path(cfg["root"]), Path(cfg["local_root"])
    node = rank * 2 // world_size
    steps = cfg["steps"]

    def manager(local: bool) -> Any:
        tier = LocalTier(local_root / f"node{node}", interval_steps=1, keep_last=2, node=node) if local else None
        return CheckpointManager(root / "persist", save_interval_steps=steps, local=tier), tier

    sd = _state(rank, cfg["local_mib"])
    host = {k: torch.empty_like(v) for k, v in sd.items()}  # preallocated host memory
    times: dict[str, list[float]] = {"local.save_blocked": [], "ref.copy_preallocated": []}
    mgr, tier = manager(True)
    for step in range(1, steps + 1):
        for t in sd.values():
            t.add_(1.0)
        tier.wait()  # the previous local save has landed: the copy below does not compete with it
        dist.barrier()  # every rank copies at once in both measurements: the same contention
        t0 = time.perf_counter()
        torch._foreach_copy_(list(host.values()), list(sd.values()))
        copy_s = time.perf_counter() - t0
        dist.barrier()
        mgr.save(step, sd)
        if step > 1:  # later saves: the first allocates the staging buffers
            times["ref.copy_preallocated"].append(copy_s)
            times["local.save_blocked"].append(tier.stats["blocked_s"])
    mgr.close()
    info: dict[str, Any] = {"bytes_per_rank": sum(t.numel() * 4 for t in sd.values()), "steps": steps}
    bw = SharedBandwidth(root / "bandwidth.state", cfg["cap_mb_s"] * 1e6)
    persist = os.path.realpath(root / "persist")
    for _ in range(cfg["reps"]):
        dist.barrier()
        if rank == world_size // 2:
            shutil.rmtree(local_root / "node1")  # node 1 is lost with its local disk
        dist.barrier()
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        with FileReads() as reads:
            mgr, tier = manager(True)
            step = mgr.restore(target)
        times.setdefault("local.recovery", []).append(time.perf_counter() - t0)
        info["local.step"], info["local.received_bytes"] = step, tier.stats.get("received_bytes")
        info["local.persistent_bytes"] = reads.bytes_from(lambda path, _: os.path.realpath(path).startswith(persist))
        info["local.exact"] = all(torch.equal(target[k], sd[k]) for k in sd)
        mgr.close()
        dist.barrier()
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        mgr, _ = manager(False)
        step = mgr.latest_step()
        reader = ThrottledFileSystemReader(mgr.location(step), bw)
        load(target, storage_reader=reader)
        times.setdefault("persistent.recovery", []).append(time.perf_counter() - t0)
        info["persistent.step"], info["persistent.bytes"] = step, reader.bytes_read
        info["persistent.exact"] = all(torch.equal(target[k], sd[k]) for k in sd)
        mgr.close()
    # over every rank: node 1's ranks are the ones that receive replicas (and could read the persistent tier)
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, (info["local.exact"] and info["persistent.exact"], info["local.received_bytes"] or 0,
                                      info["local.persistent_bytes"]))
    info["all_exact"] = all(exact for exact, _, _ in per_rank)
    info["local.received_bytes"] = sum(received for _, received, _ in per_rank)
    info["local.persistent_bytes"] = sum(persistent for _, _, persistent in per_rank)
    return {"times": times, "info": info}


def local_lines(d: dict[str, Any]) -> list[str]:
    """The results page's section."""
    s, info = d["summary"], d["info"]

    def med(key: str) -> float:
        return s[key]["median"]

    def cell(key: str) -> str:
        return f"{med(key):.3f} s ({s[key]['min']:.3f}–{s[key]['max']:.3f})"

    recovery = med("local.recovery") / med("persistent.recovery")
    blocked = med("local.save_blocked") / med("ref.copy_preallocated")
    return ["", "## Local tier with peer replicas: node 1 lost", "",
            f"4 ranks as 2 nodes, {info['bytes_per_rank'] / 2**20:.0f} MiB per rank, the persistent tier "
            f"behind a shared {d['cap_mb_s']:g} MB/s cap; median (min–max) of {s['local.recovery']['n']} run(s).", "",
            "| measure | local tier | reference | ratio (goal) |", "|---|---|---|---|",
            f"| recovery, job start → restored | {cell('local.recovery')} | persistent tier {cell('persistent.recovery')}"
            f" | {recovery:.2f} (≤ 0.2) |",
            f"| training blocked per local save | {cell('local.save_blocked')} | copy into preallocated host memory "
            f"{cell('ref.copy_preallocated')} | {blocked:.2f} (≤ 1.3) |",
            f"| bytes read from the persistent tier | {info['local.persistent_bytes']:,} | "
            f"{info['persistent.bytes']:,} | (goal 0) |",
            f"| restored values bit-exact | {info['all_exact']} | | |"]
