"""Soak benchmark: many rounds of saves, async saves and loads with random faults.

``python -m hyper_parallel_dcp.benchmarks.soak --rounds 200 --ranks 3``

Each round is a fresh job of ``--ranks`` gloo processes on CPU.  It runs one operation
(save, async save, load or broadcast load) and, with probability ``--fault-rate``, one
random rank (or its async writer) SIGKILLs itself at a random phase through the core
fault hook (:func:`hyper_parallel_dcp.core.settings.fault_point`).  Saves go into directories that
already hold a complete checkpoint, so a fault there must leave the old one intact.
After a faulted async save the same job saves again, which must land on every rank.

Reported (must all be 0): **hangs** (a job still running after its deadline), **wrong
values** (a load that returned other values than saved), **lost complete checkpoints**
(a checkpoint that was complete and is no longer, or loads other values), **unexpected
outcomes** (a fault not surfaced as an error on a survivor, or an error without a
fault).  Also: how long each failure took to surface on the survivors, from the moment
the fault fired (the hook writes it) to the survivor's exception.  Writes a JSON
report with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

__all__ = ["main"]

_SAVE_PHASES = ("save.setup", "save.plan", "save.write", "save.commit")
_LOAD_PHASES = ("load.setup", "load.plan", "load.read")
_OPS = ("save", "async_save", "load", "broadcast load")


def _state(value: float, rank: int, world: int) -> dict:
    import torch

    # "w" replicated (written once, broadcast on load), "own{r}" rank-local, "step" an object
    return {"w": torch.full((32, 8), value), f"own{rank}": torch.full((16,), value + rank),
            "step": int(value), "rank_note": f"rank{rank}-{value}"}


def _target(rank: int) -> dict:
    import torch

    return {"w": torch.zeros(32, 8), f"own{rank}": torch.zeros(16), "step": -1, "rank_note": ""}


def _matches(got: dict, value: float, rank: int) -> bool:
    want = _state(value, rank, 0)
    return (bool((got["w"] == want["w"]).all()) and bool((got[f"own{rank}"] == want[f"own{rank}"]).all())
            and got["step"] == want["step"])


def _round(rank: int, world: int, spec: dict) -> dict:
    """One round's operation on one rank; returns what happened here."""
    import hyper_parallel_dcp as dcp

    out: dict = {"error": None, "seconds": 0.0, "wrong": 0}
    if spec["fault"]:
        from hyper_parallel_dcp.core.settings import FAULT, FAULT_ONCE

        os.environ[FAULT.name] = spec["fault"]  # the hook reads them when a phase starts
        os.environ[FAULT_ONCE.name] = spec["once"]
    started = time.monotonic()
    try:
        if spec["op"] == "save":
            dcp.save(_state(spec["value"], rank, world), checkpoint_id=spec["dir"])
        elif spec["op"] == "async_save":
            dcp.async_save(_state(spec["value"], rank, world), checkpoint_id=spec["dir"]).get_result(300)
        else:
            target = _target(rank)
            dcp.load(target, checkpoint_id=spec["dir"], broadcast_replicated_tensors=spec["op"] == "broadcast load")
            out["wrong"] += int(not _matches(target, spec["expect"], rank))
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["error_at"] = time.time()
    out["seconds"] = time.monotonic() - started
    if spec["op"] == "async_save":
        # resynchronisation: the next async_save of this job lands on every rank
        started = time.monotonic()
        try:
            dcp.async_save(_state(spec["value"] + 0.5, rank, world), checkpoint_id=spec["dir2"]).get_result(300)
            target = _target(rank)
            dcp.load(target, checkpoint_id=spec["dir2"])
            out["wrong"] += int(not _matches(target, spec["value"] + 0.5, rank))
        except Exception as exc:  # noqa: BLE001
            out["next_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["next_seconds"] = time.monotonic() - started
    return out


def _child(rank: int, world: int, store: str, results: Any, env: dict, spec: dict, deadline_s: float) -> None:
    import faulthandler

    os.setpgid(0, 0)  # this rank and its async writer: killed together if the round hangs
    # a round that hangs shows where every thread of every rank was
    faulthandler.dump_traceback_later(max(1.0, deadline_s - 5), exit=False, file=sys.stderr)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        results.put((rank, "ok", _round(rank, world, spec)))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "error", "".join(traceback.format_exception(exc))[-2000:]))
    results.close()
    results.join_thread()
    os._exit(0)  # no process-group teardown, which may wait on a dead peer


def _run_job(spec: dict, world: int, env: dict, deadline_s: float) -> tuple[dict, bool]:
    """Run one round on ``world`` processes; returns ({rank: outcome}, hung)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="hp-dcp-soak-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world, store, results, env, spec, deadline_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and len(out) < world:
            try:
                rank, status, value = results.get(timeout=0.2)
                out[rank] = (status, value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and p.exitcode != 0:
                        out[r] = ("died", p.exitcode)
        hung = len(out) < world
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
            if hung and p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its writer too, or it would finish the save later
                except ProcessLookupError:
                    pass
    return out, hung


def _check_complete(path: Path, value: float, world: int) -> bool:
    """The checkpoint at ``path`` verifies and loads ``value`` (single process)."""
    from hyper_parallel_dcp import load
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    if not verify_checkpoint(path).ok:
        return False
    import torch

    target = {"w": torch.zeros(32, 8), "step": -1}
    for r in range(world):
        target[f"own{r}"] = torch.zeros(16)
    try:
        load(target, checkpoint_id=str(path), no_dist=True)
    except Exception:  # noqa: BLE001
        return False
    return all(_matches(target, value, r) for r in range(world))


def soak(rounds: int, world: int, fault_rate: float, seed: int, timeout_s: float, workdir: Path,
         log: Any = sys.stdout) -> dict:
    rng = random.Random(seed)
    env = {"HP_DCP_COLLECTIVE_TIMEOUT": str(timeout_s), "HP_DCP_ASYNC_TIMEOUT": str(max(30.0, 4 * timeout_s)),
           "OMP_NUM_THREADS": "1"}
    # generous: a round on a busy 2-core machine (3 ranks, 3 writers starting) can take a minute
    deadline = 150.0 + 10 * timeout_s
    complete: dict[str, float] = {}  # directory -> value of the complete checkpoint there
    report: dict[str, Any] = {"rounds": 0, "hangs": 0, "wrong_values": 0, "lost_complete_checkpoints": 0,
                              "unexpected": 0, "faults": 0, "surface_seconds": {}, "resync_failures": 0,
                              "events": []}
    # a first complete checkpoint to load and to overwrite
    first = str(workdir / "ckpt_a")
    outcome, hung = _run_job({"op": "save", "dir": first, "value": 1.0, "fault": "", "once": ""}, world, env, deadline)
    assert not hung and all(s == "ok" and v["error"] is None for s, v in outcome.values()), outcome
    complete[first] = 1.0
    value = 1.0
    started_all = time.monotonic()
    for n in range(rounds):
        op = rng.choice(_OPS)
        value += 1.0
        faulted = rng.random() < fault_rate
        killed = rng.randrange(world)
        phases = _SAVE_PHASES if op in ("save", "async_save") else _LOAD_PHASES + (
            ("load.broadcast",) if op == "broadcast load" else ())
        phase = rng.choice(phases) if faulted else ""
        target = rng.choice(sorted(complete)) if op in ("load", "broadcast load") else str(
            workdir / rng.choice(("ckpt_a", "ckpt_b")))
        once = str(workdir / f"fired-{n}")
        spec = {"op": op, "dir": target, "dir2": str(workdir / "ckpt_next"), "value": value,
                "expect": complete.get(target, -1.0), "fault": f"{phase}@{killed}" if faulted else "", "once": once}
        t0 = time.monotonic()
        outcome, hung = _run_job(spec, world, env, deadline)
        fired = Path(once).exists()
        event: dict[str, Any] = {"round": n, "op": op, "fault": spec["fault"], "fired": fired,
                                 "seconds": round(time.monotonic() - t0, 2)}
        report["rounds"] += 1
        report["faults"] += int(fired)
        if hung:
            report["hangs"] += 1
            event["hang"] = True
        killed_rank = killed if fired and op != "async_save" else None
        errors = []
        for r, (status, v) in sorted(outcome.items()):
            if r == killed_rank:
                if status != "died":
                    report["unexpected"] += 1
                    event.setdefault("problems", []).append(f"rank {r} was to die but: {status}")
                continue
            if status != "ok":
                report["unexpected"] += 1
                event.setdefault("problems", []).append(f"rank {r}: {status} {str(v)[-300:]}")
                continue
            report["wrong_values"] += v["wrong"]
            if v["wrong"]:
                event.setdefault("problems", []).append(f"rank {r}: wrong values")
            if v["error"] is not None:
                errors.append(v["error"])
                if fired:
                    # from the moment the fault fired (written by the hook) to this rank's error
                    fired_at = float(Path(once).read_text() or "nan")
                    report["surface_seconds"].setdefault(op, []).append(round(v["error_at"] - fired_at, 3))
                    event.setdefault("surface", []).append(round(v["error_at"] - fired_at, 3))
            if "next_error" in v:
                report["resync_failures"] += 1
                event.setdefault("problems", []).append(f"rank {r}: next async_save failed: {v['next_error']}")
        survivors = [r for r in range(world) if r != killed_rank]
        if fired and len(errors) != len(survivors):
            report["unexpected"] += 1
            event.setdefault("problems", []).append(f"fault surfaced on {len(errors)} of {len(survivors)} survivors")
        if not fired and errors:
            report["unexpected"] += 1
            event.setdefault("problems", []).append(f"errors without a fault: {errors[:1]}")
        if errors:
            event["error"] = errors[0][:160]
        # bookkeeping: what is complete now
        if op in ("save", "async_save") and not fired and not errors:
            complete[target] = value
        if op == "async_save" and all(s == "ok" and "next_error" not in v for s, v in outcome.values()):
            complete[str(spec["dir2"])] = value + 0.5
        for path, val in sorted(complete.items()):
            if not _check_complete(Path(path), val, world):
                report["lost_complete_checkpoints"] += 1
                event.setdefault("problems", []).append(f"complete checkpoint {path} ({val}) lost")
                complete.pop(path)
                if not complete:
                    break
        report["events"].append(event)
        print(json.dumps(event), file=log, flush=True)
        if not complete:  # nothing left to load: start again from a fresh checkpoint
            outcome, _ = _run_job({"op": "save", "dir": first, "value": value, "fault": "", "once": ""}, world, env,
                                  deadline)
            complete[first] = value
    report["wall_seconds"] = round(time.monotonic() - started_all, 1)
    report["surface_summary"] = {
        op: {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}
        for op, xs in report["surface_seconds"].items()
    }
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyper_parallel_dcp.benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="rounds (one job each; default 200)")
    p.add_argument("--ranks", type=int, default=3, help="ranks per job (default 3)")
    p.add_argument("--fault-rate", type=float, default=0.5, help="share of rounds with a fault (default 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0, help="HP_DCP_COLLECTIVE_TIMEOUT for the jobs (default 5 s)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--workdir", type=Path, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hp-dcp-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = soak(args.rounds, args.ranks, args.fault_rate, args.seed, args.timeout, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = {k: v for k, v in report.items() if k not in ("events", "surface_seconds")}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    bad = report["hangs"] + report["wrong_values"] + report["lost_complete_checkpoints"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
