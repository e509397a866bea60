"""Test helpers shared by every package: real multi-process gloo runs on CPU.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes that meet
through a file store in a temporary directory, calls ``fn(rank, world_size, *args)`` in
each (``fn`` must be a module-level function), and returns the per-rank results.  Every
rank's traceback is collected; a rank that fails or does not finish by the deadline is
named in the raised :class:`DistributedTestError`.  ``run_ranks_allowing_deaths`` is the
variant for crash tests: a rank may die (be SIGKILLed), and every rank's outcome comes back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

__all__ = ["DistributedTestError", "run_distributed", "run_ranks_allowing_deaths"]


class DistributedTestError(AssertionError):
    """One or more ranks of a distributed test failed or hung."""


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, results: Any,
            env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Plain pickle, not the queue's ForkingPickler: torch would move a returned tensor
        # into shared memory owned by this process, which exits right after, and the
        # parent's unpickling then hangs.  By value, tensors come back safely.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hp-dcp-dist-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, rank, world_size, store, results, dict(env or {}), args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                    if dead:
                        # give the queue a moment: a rank may have reported just before dying
                        time.sleep(0.5)
                        while True:
                            try:
                                rank, status, value = results.get_nowait()
                                outcome[rank] = (status, value)
                            except queue.Empty:
                                break
                        for r in dead:
                            outcome.setdefault(r, ("error", f"process exited with code {procs[r].exitcode}"))
                        if any(s == "error" for s, _ in outcome.values()):
                            break
                    continue
                outcome[rank] = (status, value)
                if status == "error":
                    # others may be stuck in a collective with the failed rank; give them a moment
                    deadline = min(deadline, time.monotonic() + 15.0)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        parts = [f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        if missing:
            parts.append(f"--- rank(s) {missing} did not finish within {timeout:.0f} s")
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(parts))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def _worker_allowing_deaths(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, results: Any,
                            env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc))))
    results.close()
    results.join_thread()  # the result must be in the pipe before the hard exit below
    os._exit(0)  # skip the process group teardown, which may wait on a dead peer


def run_ranks_allowing_deaths(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                              env: dict[str, str] | None = None) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on gloo ranks, some of which may die.

    Returns ``{rank: ("ok", value) | ("error", traceback text) | ("died", exitcode)}``;
    a rank still running at the deadline is killed and reported as ``("died", None)``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[int, tuple[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hp-dcp-crash-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker_allowing_deaths,
                             args=(fn, r, world_size, store, results, dict(env or {}), args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
                out[rank] = (status, pickle.loads(value) if status == "ok" else value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and p.exitcode != 0:
                        out[r] = ("died", p.exitcode)
        for r, p in enumerate(procs):
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
                out.setdefault(r, ("died", None))
            elif r not in out:
                out[r] = ("died", p.exitcode)
    return out
