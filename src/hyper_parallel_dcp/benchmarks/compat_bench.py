"""The ``torch_compat`` rows of the io benchmark alone, and the floor torch's planners put on them.

``python -m hyper_parallel_dcp.benchmarks.compat_bench [--reps N]`` runs, on 2 gloo ranks,
the io benchmark's own save and load cases (:func:`io_bench._save_cases` and
``_load_cases``: ours, torch's ``FileSystemWriter`` / ``Reader``, the plugin through
torch's API and through ``torch_compat.save`` / ``load``, interleaved) on the default
preset's dense and small state dicts, then times torch's ``DefaultSavePlanner`` and
``DefaultLoadPlanner`` alone on the same state dicts (``set_up_planner`` through
``finish_plan``, the coordinator's global step included, collectives and GC left out):
time no storage plugin can remove, and ours (the ``build_local_plan`` and
``build_global_plan`` phases of a native save with the plan cache cleared, and of a load),
which the plugin does not run.  Prints medians and ranges in milliseconds, and the floor
torch's planners put on the plugin's ratio: ``(ours - our planning + torch's planning) / ours``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["compat_worker", "main"]


def _torch_planning(sd: dict, target: dict, plugin: Path, reps: int) -> dict[str, list[float]]:
    """Seconds of torch's save and load planning on this rank (the coordinator's global step included)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from hyper_parallel_dcp.core.gc_pause import gc_paused
    from hyper_parallel_dcp.torch_compat import StorageReader

    rank, world = dist.get_rank(), dist.get_world_size()
    metadata = StorageReader(plugin).read_metadata()
    times: dict[str, list[float]] = {"torch_planner.save": [], "torch_planner.load": []}
    for _ in range(reps):
        cases: list[tuple[str, Any, dict, Any]] = [("save", DefaultSavePlanner(), sd, None),
                                                   ("load", DefaultLoadPlanner(), target, metadata)]
        for name, planner, state, extra in cases:
            with gc_paused():
                t0 = time.perf_counter()
                planner.set_up_planner(state, extra, rank == 0)
                local = planner.create_local_plan()
                spent = time.perf_counter() - t0
                plans: list[Any] = [None] * world
                dist.all_gather_object(plans, local)
                t0 = time.perf_counter()
                central = planner.create_global_plan(plans)
                central = central[0] if name == "save" else central
                planner.finish_plan(central[rank])
                times[f"torch_planner.{name}"].append(spent + time.perf_counter() - t0)
    return times


def _our_planning(sd: dict, target: dict, path: Path, reps: int) -> dict[str, list[float]]:
    """Seconds of our planning phases in native saves (plan cache cleared) and loads, this rank."""
    import logging

    import torch.distributed as dist

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.core.settings import logger
    from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner

    from .io_bench import _rm

    spent: list[float] = []

    class _Planning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.args, tuple) and record.args[1:2] in (("build_local_plan",), ("build_global_plan",)):
                spent[-1] += float(record.args[2])  # type: ignore[arg-type]

    handler, level = _Planning(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    times: dict[str, list[float]] = {"ours_planner.save": [], "ours_planner.load": []}
    try:
        for _ in range(reps):
            StandardSavePlanner.clear_cache()
            _rm(path, dist.get_rank())
            for name, call in (("save", lambda: hp.save(sd, checkpoint_id=path)),
                               ("load", lambda: hp.load(target, checkpoint_id=path))):
                spent.append(0.0)
                call()
                times[f"ours_planner.{name}"].append(spent[-1])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    _rm(path, dist.get_rank())
    return times


def compat_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    import torch

    from .io_bench import _io_state_dicts, _load_cases, _numel, _OurLoads, _plugin_path, _Recorder, _rm, _save_cases
    from .state_dicts import dense_shapes, small_shapes

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
    root = Path(cfg["root"])
    shapes = dense_shapes(cfg["dense_mib"]) if cfg["kind"] == "dense" else small_shapes(cfg["count"], cfg["kib"])
    sd, target, flipped = _io_state_dicts(shapes, world_size)
    rec = _Recorder()
    rec.info["global_bytes"] = sum(2 * _numel(s) for _, s, _ in shapes)
    ours, theirs = root / "ours", root / "torch"
    _save_cases(rec, sd, ours, theirs, rank, cfg["reps"])
    _load_cases(rec, _OurLoads(ours), sd, target, flipped, theirs, cfg["reps"])
    rec.times.update(_torch_planning(sd, target, _plugin_path(ours), 2 * cfg["reps"] + 1))
    rec.times.update(_our_planning(sd, target, ours, 2 * cfg["reps"] + 1))
    for path in (ours, theirs, _plugin_path(ours)):
        _rm(path, rank)
    return rec.times


def main(argv: Optional[Sequence[str]] = None) -> int:
    import tempfile

    from hyper_parallel_dcp.core.testing import run_distributed

    from .cli import PRESETS
    from .report import summarize

    dense_mib, count, kib, *_ = PRESETS["default"]
    p = argparse.ArgumentParser(prog="python -m hyper_parallel_dcp.benchmarks.compat_bench", description=__doc__)
    p.add_argument("--reps", type=int, default=3, help="as the io benchmark's: 2 x reps + 1 of each case")
    p.add_argument("--kinds", default="dense,small")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hp-dcp-compat-") as tmp:
        for kind in args.kinds.split(","):
            cfg = {"kind": kind, "dense_mib": dense_mib, "count": count, "kib": kib, "reps": args.reps,
                   "root": str(Path(tmp) / kind)}
            times = run_distributed(compat_worker, 2, cfg, timeout=3600)[0]
            med = {name: summarize(values) for name, values in sorted(times.items())}
            for name, s in med.items():
                print(f"{kind:5s} {name:28s} {1e3 * s['median']:8.1f} ms ({1e3 * s['min']:.1f}-{1e3 * s['max']:.1f}, "
                      f"n={s['n']})", flush=True)
            for case in ("save", "load"):
                ours = med[f"ours.{case}"]["median"]
                floor = (ours - med[f"ours_planner.{case}"]["median"] + med[f"torch_planner.{case}"]["median"]) / ours
                print(f"{kind:5s} floor of plugin.{case} / ours.{case}: {floor:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
