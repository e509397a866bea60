"""``python -m hyper_parallel_dcp.benchmarks``: run everything, write ``docs/benchmarks/``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main"]

# name -> (dense MiB, small count, small KiB, broadcast MiB, reps, secondary reps, planning worlds)
PRESETS: dict[str, tuple[float, int, float, float, int, int, tuple[int, ...]]] = {
    "quick": (32, 200, 64, 16, 1, 1, (64, 256)),
    "default": (256, 2000, 128, 64, 3, 1, (1024, 8192, 16384)),
    "full": (1024, 2000, 512, 256, 5, 3, (64, 256, 1024, 2048, 4096, 8192, 16384)),
}

#: the per-tensor case of every preset: (count, KiB) — whole save / load time ÷ count
TINY = (1000, 4.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyper_parallel_dcp.benchmarks",
        description="Benchmark hyper-parallel-dcp against torch.distributed.checkpoint (gloo on CPU) and the "
                    "hardware (raw write/read, memcpy), plus planning at scale by simulation. Writes JSON, a "
                    "markdown table and PNG plots.",
    )
    p.add_argument("--quick", action="store_const", const="quick", dest="preset",
                   help="tiny sizes, one repetition (~1-2 minutes): a smoke test")
    p.add_argument("--full", action="store_const", const="full", dest="preset",
                   help="the issue's sizes (1 GiB dense, 2000 x 0.5 MiB), 5 repetitions: for bigger machines")
    p.set_defaults(preset="default")
    p.add_argument("--world", type=int, default=2, help="ranks for save/load (default 2)")
    p.add_argument("--dense-mib", type=float, help="size of the dense LLM-like state dict (MiB)")
    p.add_argument("--small-count", type=int, help="number of small sharded tensors")
    p.add_argument("--small-kib", type=float, help="size of each small tensor (KiB, global)")
    p.add_argument("--tiny-count", type=int, default=TINY[0],
                   help=f"tensors of the per-tensor cost case (default {TINY[0]}; 0 skips it)")
    p.add_argument("--tiny-kib", type=float, default=TINY[1],
                   help=f"size of each tensor of the per-tensor cost case (KiB, global; default {TINY[1]:g})")
    p.add_argument("--bcast-mib", type=float, help="size of the replicated state dict for broadcast loads")
    p.add_argument("--bcast-worlds", default="2,4", help="replication factors for broadcast loads (default 2,4)")
    p.add_argument("--cap-mb-s", type=float, default=200.0, help="shared storage bandwidth cap for broadcast loads")
    p.add_argument("--local-mib", type=float, help="state per rank of the local tier section (default: --bcast-mib)")
    p.add_argument("--reps", type=int, help="repetitions per case (secondary cases too)")
    p.add_argument("--plan-worlds", help="comma-separated simulated world sizes for planning")
    p.add_argument("--sections", default="io,broadcast,local,convert,incremental,compression,planning",
                   help="comma-separated subset of io,broadcast,local,convert,incremental,compression,planning")
    p.add_argument("--workdir", help="where checkpoints are written (default: a temp dir; needs ~3x the sizes)")
    p.add_argument("--out", default="docs/benchmarks", help="output folder (default docs/benchmarks)")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for each multi-process run (s)")
    p.add_argument("--render", metavar="RESULTS_JSON",
                   help="only re-render README.md and the plots from an earlier results.json into --out")
    return p


def _save_writes() -> str:
    """The boundaries a save's writes end on here, and why (``storage_fs.host_memory``)."""
    from hyper_parallel_dcp.core.settings import ALIGNED_WRITES
    from hyper_parallel_dcp.storage_fs.host_memory import free_page_reporting, large_folio_writes

    size = "2 MiB" if large_folio_writes() else "256 KiB"
    setting = ALIGNED_WRITES.get()
    if setting is not None:
        return f"{size} (HP_DCP_ALIGNED_WRITES={int(setting)})"
    why = "a VM reporting free pages to its host" if free_page_reporting() else "no free page reporting"
    return f"{size} (HP_DCP_ALIGNED_WRITES=auto: {why})"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.system()} {platform.release()}, {os.cpu_count()} CPU ({cpu}), {mem:.0f} GiB RAM, "
            f"load average {load:.1f} at start")


def _summaries(times: dict[str, list[float]]) -> dict[str, Any]:
    from .report import summarize

    return {k: summarize(v) for k, v in times.items()}


def _run_io(cfg: dict[str, Any], world: int, timeout: float, log) -> dict[str, Any]:
    from hyper_parallel_dcp.core.testing import run_distributed

    from .io_bench import io_worker

    out = {}
    for kind in ("dense", "small", "tiny"):
        if kind == "tiny" and not cfg.get("tiny_count"):
            continue
        t0 = time.perf_counter()
        results = run_distributed(io_worker, world, dict(cfg, kind=kind), timeout=timeout)
        r0 = results[0]
        out[kind] = {"world": world, "summary": _summaries(r0["times"]), "times": r0["times"], "info": r0["info"],
                     "wall_s": time.perf_counter() - t0}
        s = out[kind]["summary"]
        if kind == "tiny":
            n = r0["info"]["tensors"]
            log(f"io tiny ({n} tensors): ours save {s['ours.save']['median']:.3f}s "
                f"({1000 * s['ours.save']['median'] / n:.3f} ms a tensor), torch save {s['torch.save']['median']:.3f}s | "
                f"ours load {s['ours.load']['median']:.3f}s ({1000 * s['ours.load']['median'] / n:.3f} ms a tensor), "
                f"torch load {s['torch.load']['median']:.3f}s ({out[kind]['wall_s']:.0f}s)")
            continue
        log(f"io {kind}: ours save {s['ours.save']['median']:.3f}s torch save {s['torch.save']['median']:.3f}s "
            f"raw write {s['ref.raw_write_fsync']['median']:.3f}s | ours load {s['ours.load']['median']:.3f}s "
            f"torch load {s['torch.load']['median']:.3f}s ({out[kind]['wall_s']:.0f}s)")
    return out


def _run_broadcast(cfg: dict[str, Any], worlds: Sequence[int], timeout: float, log) -> dict[str, Any]:
    from hyper_parallel_dcp.core.testing import run_distributed

    from .io_bench import broadcast_worker

    runs = {}
    for world in worlds:
        results = run_distributed(broadcast_worker, world, cfg, timeout=timeout)
        runs[world] = {"summary": _summaries(results[0]["times"]), "info": results[0]["info"]}
        log(f"broadcast world={world}: " + ", ".join(f"{k} {v['median']:.3f}s" for k, v in runs[world]["summary"].items()))
    return {"cap_mb_s": cfg["cap_mb_s"], "mib": cfg["bcast_mib"], "runs": runs}


def _run_local(cfg: dict[str, Any], timeout: float, log) -> dict[str, Any]:
    from hyper_parallel_dcp.core.testing import run_distributed

    from .local_bench import local_tier_worker

    results = run_distributed(local_tier_worker, 4, cfg, timeout=timeout)
    out = {"cap_mb_s": cfg["cap_mb_s"], "summary": _summaries(results[0]["times"]), "info": results[0]["info"]}
    s, info = out["summary"], out["info"]
    log(f"local tier: recovery {s['local.recovery']['median']:.3f}s vs persistent "
        f"{s['persistent.recovery']['median']:.3f}s, {info['local.persistent_bytes']} bytes from persistent; "
        f"blocked per save {s['local.save_blocked']['median']:.4f}s vs preallocated copy "
        f"{s['ref.copy_preallocated']['median']:.4f}s; bit-exact {info['all_exact']}")
    return out


def _run_convert(root: Path, mib: float, reps: int, log) -> dict[str, Any]:
    from .io_bench import feature_available

    if not feature_available("convert"):
        return {"status": "not available (hyper_parallel_dcp.offline_transform not installed)"}
    import torch
    from safetensors.torch import save_file

    from hyper_parallel_dcp.offline_transform import convert_dcp_to_huggingface, convert_full_checkpoint_to_dcp

    from . import references as ref
    from .state_dicts import dense_shapes, make_state_dict

    torch.set_num_threads(1)
    sd = make_state_dict(dense_shapes(mib))
    hf = root / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(hf / "model.safetensors"))
    tensors = list(sd.values())
    nbytes = sum(t.numel() * 2 for t in tensors)
    del sd
    times: dict[str, list[float]] = {}
    buf = bytearray((hf / "model.safetensors").stat().st_size)
    for _ in range(reps):
        t_read = ref.raw_read(hf / "model.safetensors", buf)
        t_write = ref.raw_write(root / "raw_copy.bin", tensors)
        times.setdefault("ref.raw_read_write", []).append(t_read + t_write)
        shutil.rmtree(root / "dcp", ignore_errors=True)
        t0 = time.perf_counter()
        convert_full_checkpoint_to_dcp(hf, root / "dcp")
        times.setdefault("hf_to_dcp", []).append(time.perf_counter() - t0)
        shutil.rmtree(root / "hf_out", ignore_errors=True)
        t0 = time.perf_counter()
        convert_dcp_to_huggingface(root / "dcp", root / "hf_out")
        times.setdefault("dcp_to_hf", []).append(time.perf_counter() - t0)
    shutil.rmtree(root / "hf", ignore_errors=True)
    summary = _summaries(times)
    log("convert: " + ", ".join(f"{k} {v['median']:.3f}s" for k, v in summary.items()))
    return {"summary": summary, "bytes": nbytes}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.render:
        from .report import write_markdown, write_plots

        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        rendered = json.loads(Path(args.render).read_text())
        write_markdown(out_dir / "README.md", rendered)
        write_plots(out_dir, rendered)
        return 0
    dense_mib, small_count, small_kib, bcast_mib, reps, reps2, plan_worlds = PRESETS[args.preset]
    cfg = {
        "dense_mib": args.dense_mib or dense_mib,
        "small_count": args.small_count or small_count,
        "small_kib": args.small_kib or small_kib,
        "tiny_count": args.tiny_count,
        "tiny_kib": args.tiny_kib,
        "bcast_mib": args.bcast_mib or bcast_mib,
        "reps": args.reps or reps,
        "reps_secondary": args.reps or reps2,
        "cap_mb_s": args.cap_mb_s,
        "local_mib": args.local_mib or bcast_mib,
    }
    worlds = tuple(int(w) for w in args.plan_worlds.split(",")) if args.plan_worlds else plan_worlds
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    import torch

    from .io_bench import feature_available

    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m hyper_parallel_dcp.benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": _machine(),
        "save_writes": _save_writes(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "config": dict(cfg, world=args.world, plan_worlds=list(worlds), preset=args.preset),
        "features": {name: feature_available(name) for name in ("async", "broadcast", "convert")},
        "io": {},
    }
    tmp = tempfile.mkdtemp(prefix="hp-dcp-bench-", dir=args.workdir)
    try:
        if "io" in sections:
            result["io"] = _run_io(dict(cfg, root=str(Path(tmp) / "io")), args.world, args.timeout, log)
        if "broadcast" in sections:
            bworlds = [int(w) for w in args.bcast_worlds.split(",") if w]
            result["broadcast"] = _run_broadcast(dict(cfg, root=str(Path(tmp) / "bcast")), bworlds, args.timeout, log)
        if "local" in sections:
            local_root = Path("/dev/shm") if Path("/dev/shm").is_dir() and not args.workdir else Path(tmp)
            local_dir = tempfile.mkdtemp(prefix="hp-dcp-bench-local-", dir=local_root)
            try:
                result["local"] = _run_local(dict(cfg, root=str(Path(tmp) / "local"), local_root=local_dir,
                                                  steps=8), args.timeout, log)
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)
        if "convert" in sections:
            result["convert"] = _run_convert(Path(tmp) / "convert", cfg["bcast_mib"], cfg["reps"], log)
        if "incremental" in sections:
            from .incremental_bench import run_incremental

            result["incremental"] = run_incremental(Path(tmp) / "incremental", cfg["bcast_mib"], cfg["reps"], log,
                                                    large_mib=None if args.preset == "quick" else 1024)
        if "compression" in sections:
            from .compression_bench import run_compression

            result["compression"] = run_compression(512 if args.preset == "quick" else 1024, 5, cfg["reps"], log,
                                                    Path(tmp) / "compression", cfg["cap_mb_s"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "planning" in sections:
        from .planning_sim import run_planning

        result["planning"] = run_planning(worlds, log=log)
    from .report import evaluate_goals, write_markdown, write_plots

    result["goals"] = evaluate_goals(result["io"], result.get("planning"))
    if result.get("incremental"):
        from .incremental_bench import incremental_goals

        result["goals"] += incremental_goals(result["incremental"])
    result["total_s"] = time.perf_counter() - started
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    write_markdown(out_dir / "README.md", result)
    plots = write_plots(out_dir, result)
    log(f"wrote {out_dir}/results.json, README.md, {', '.join(plots) or 'no plots (matplotlib missing)'}")
    for g in result["goals"]:
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        log(f"goal: {g['goal']}: {g['measured']} -> {verdict}")
    return 0
