"""Measure async_save against a plain host copy, torch DCP's async_save and a sync save.

``run_benchmark(root, total_mib, n_tensors, repeats)`` returns a dict of numbers (seconds,
bytes); ``python packages/dcp-async/benchmarks/bench_async.py ROOT [MiB]`` prints them as JSON
(it needs the umbrella installed, so it lives outside the package).
One process, CPU tensors: "blocking" is call → return; "landed" is call → metadata.
Memory is sampled every 5 ms from ``/proc/<pid>/smaps_rollup`` of this process and the
writer process (PSS counts the shared staging buffers once, RSS counts them in both).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["run_benchmark"]


def _mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB of ``pid``; (0, 0) when it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


class _MemSampler:
    def __init__(self, pids: Callable[[], list[int]]):
        self.pids = pids
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = pss = 0
            for pid in self.pids():
                r, p = _mem_kib(pid)
                rss += r
                pss += p
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            time.sleep(0.005)

    def __enter__(self) -> _MemSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _state_dict(total_mib: int, n_tensors: int) -> dict[str, Any]:
    per = total_mib * 1024 * 1024 // 4 // n_tensors
    cols = 1024
    rows = max(1, per // cols)
    gen = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {f"layer{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(n_tensors)}
    sd["step"] = 7
    return sd


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run_benchmark(root: str | os.PathLike, total_mib: int = 512, n_tensors: int = 64, repeats: int = 3) -> dict:
    """Run every measurement on one state dict of ``total_mib`` MiB; returns the numbers.

    Writes checkpoints under ``root`` (removed between runs).  Medians over ``repeats``
    steady-state runs; the first async save (writer start, buffer allocation) separately.
    """
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.async_persist.persist import _get_persister

    def writer_pid() -> int:
        writer = _get_persister().writer
        return writer.pid if writer is not None and writer.alive() else 0

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    sd = _state_dict(total_mib, n_tensors)
    staged_bytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def fresh(name: str) -> Path:
        p = root / name
        shutil.rmtree(p, ignore_errors=True)
        return p

    out: dict[str, Any] = {"staged_bytes": staged_bytes, "n_tensors": n_tensors, "repeats": repeats}
    clone = []
    for _ in range(repeats):
        t, copies = _timed(lambda: {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)})
        clone.append(t)
        del copies
    out["host_copy_clone_s"] = median(clone)

    sync = [_timed(lambda: dcp.save(sd, checkpoint_id=fresh("sync")))[0] for _ in range(repeats)]
    out["sync_save_s"] = median(sync)

    me = os.getpid()
    base_rss, base_pss = _mem_kib(me)
    first_block, resp = _timed(lambda: dcp.async_save(sd, checkpoint_id=fresh("async0")))
    first_landed = first_block + _timed(lambda: resp.get_result(600))[0]
    out["first_async_blocking_s"] = first_block
    out["first_async_landed_s"] = first_landed
    blocking, landed, peaks = [], [], []
    for i in range(repeats):
        writer = writer_pid()
        idle = [_mem_kib(p) for p in (me, writer) if p]
        path = fresh(f"async{i + 1}")
        with _MemSampler(lambda: [p for p in (me, writer_pid()) if p]) as mem:
            start = time.perf_counter()
            resp = dcp.async_save(sd, checkpoint_id=path)
            blocking.append(time.perf_counter() - start)
            resp.get_result(600)
            landed.append(time.perf_counter() - start)
        peaks.append((mem.peak_rss - sum(r for r, _ in idle), mem.peak_pss - sum(p for _, p in idle)))
    out["async_blocking_s"] = median(blocking)
    out["async_landed_s"] = median(landed)
    writer_rss, writer_pss = _mem_kib(writer_pid())
    me_rss, me_pss = _mem_kib(me)
    out["staging_buffers_bytes"] = sum(t.numel() for t in _get_persister().arena.slabs.values())
    out["trainer_rss_growth_bytes"] = (me_rss - base_rss) * 1024
    out["trainer_pss_growth_bytes"] = (me_pss - base_pss) * 1024
    out["writer_rss_bytes"] = writer_rss * 1024
    out["writer_pss_bytes"] = writer_pss * 1024
    out["per_save_peak_extra_rss_bytes"] = max(p[0] for p in peaks) * 1024
    out["per_save_peak_extra_pss_bytes"] = max(p[1] for p in peaks) * 1024

    try:
        import torch.distributed.checkpoint as tdcp

        tblock, tland = [], []
        for i in range(repeats):
            start = time.perf_counter()
            fut = tdcp.async_save(sd, checkpoint_id=str(fresh(f"torch{i}")))
            tblock.append(time.perf_counter() - start)
            fut.result()  # type: ignore[union-attr]  # with its default (synchronous) staging torch returns a Future
            tland.append(time.perf_counter() - start)
        out["torch_async_blocking_s"] = median(tblock)
        out["torch_async_landed_s"] = median(tland)
    except Exception as exc:  # noqa: BLE001 - report, do not hide, a torch API difference
        out["torch_async_error"] = f"{type(exc).__name__}: {exc}"

    out["ratio_blocking_vs_clone"] = out["async_blocking_s"] / out["host_copy_clone_s"]
    out["ratio_landed_vs_sync"] = out["async_landed_s"] / out["sync_save_s"]
    if "torch_async_blocking_s" in out:
        out["ratio_blocking_vs_torch"] = out["async_blocking_s"] / out["torch_async_blocking_s"]
    out["ratio_extra_pss_vs_staged"] = (out["staging_buffers_bytes"] + out["per_save_peak_extra_pss_bytes"]) / staged_bytes
    return out


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "/tmp/hp-dcp-async-bench"
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    print(json.dumps(run_benchmark(target, total_mib=mib), indent=2))
