"""Hunt for a rank that aborts at interpreter exit after synchronous checkpoints.

A 2-rank gloo job saves and loads a small state (a DTensor sharded on dim 0, a replicated
plain tensor, optionally many small tensors) with ``hyper_parallel_dcp.save`` / ``load``
and ``CheckpointManager`` — no ``async_save``, no ``backward()`` — and exits.  Run as a
worker under torchrun (``--worker``), or as the driver that launches that job ``--runs``
times and counts launches whose exit status is not 0, keeping each failed launch's output::

    python tools/exit_abort_repro.py --runs 50 --variant manager --destroy no
    python tools/exit_abort_repro.py --runs 30 --variant plain --squeeze --cores --stop-on-failure

Variants: ``plain`` (save/load, broadcast off), ``broadcast`` (the default read-once +
broadcast load), ``many_small`` (2000 small tensors: read-ahead and broadcast busy before
exit), ``manager`` (CheckpointManager save/restore), ``all`` (every one of them in one job).
``--destroy yes`` calls ``dist.destroy_process_group()`` before exit; ``no`` leaves the group
to the interpreter's shutdown.  ``--tail library`` (default) ends with a save, so the
library's collective is the last before exit; ``--tail torch`` ends with the script's own
``DTensor.full_tensor()`` checks.  ``--squeeze`` pins each rank to one CPU and stops forced
GIL switches, which makes the abort several times likelier.  Failed runs' output (and with
``--cores`` their core dumps: ``gdb -batch -ex "thread apply all bt" python FILE.core``)
goes to ``--keep``; the abort shows as ``terminate called without an active exception``
and ``exitcode : -6`` (or -11) in torchrun's report.

What it found (torch 2.13.0+cpu, Python 3.11, 2 busy cores): before ``core/exit_drain.py``
about one launch in ten to twenty aborted without ``destroy_process_group`` (one in four
with ``--squeeze``); the aborting thread was a gloo worker releasing a finished work
(``AsyncBroadcastWork`` of the save's last ``broadcast_object_list``) at exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _worker(variant: str, destroy: bool, root: str, tail: str, squeeze: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as hp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if squeeze:
        # One CPU for all of this rank's threads, and no forced GIL hand-over: a gloo worker
        # that finishes a collective is preempted by the thread it wakes, and the main
        # thread runs on to exit without handing it the GIL.
        os.sched_setaffinity(0, {rank % os.cpu_count()})
        sys.setswitchinterval(5.0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = torch.randn(64, 16)
    shared = torch.arange(256, dtype=torch.float32)
    n_small = 2000 if variant in ("many_small", "all") else 0
    small = [torch.full((8,), float(i)) for i in range(n_small)]

    def state(scale: float) -> dict:
        sd = {"w": distribute_tensor(full * scale, mesh, [Shard(0)]), "rep": shared * scale,
              "step": int(scale)}
        for i, t in enumerate(small):
            sd[f"s{i}"] = t * scale
        return sd

    def check(sd: dict, scale: float) -> None:
        if tail == "torch":  # a torch collective of the script's own comes last before exit
            assert torch.equal(sd["w"].full_tensor(), full * scale), "w"
        else:  # no collective but the library's
            assert torch.equal(sd["w"].to_local(), (full * scale).chunk(dist.get_world_size())[rank]), "w"
        assert torch.equal(sd["rep"], shared * scale), "rep"
        for i, t in enumerate(small):
            assert torch.equal(sd[f"s{i}"], t * scale), f"s{i}"

    def blank() -> dict:
        sd = state(0.0)
        sd["step"] = -1
        return sd

    if variant in ("plain", "broadcast", "many_small", "all"):
        for k in (1, 2, 3):
            path = os.path.join(root, f"plain_{k}")
            hp.save(state(float(k)), checkpoint_id=path)
            target = blank()
            hp.load(target, checkpoint_id=path, broadcast_replicated_tensors=(variant != "plain"))
            check(target, float(k))
    if variant in ("manager", "all"):
        with hp.CheckpointManager(os.path.join(root, "mgr"), keep_last=2, save_interval_steps=1) as mgr:
            for step in (1, 2, 3, 4):
                mgr.save(step, state(float(step)))
            target = blank()
            assert mgr.restore(target) == 4
            check(target, 4.0)
            if tail == "library":  # a trainer's last act: the final save, then leave the block
                mgr.save(5, state(5.0))
    elif tail == "library":
        hp.save(state(5.0), checkpoint_id=os.path.join(root, "final"))
    if destroy:
        dist.destroy_process_group()
    if rank == 0:
        print("worker done", flush=True)


def _core_dumps_on() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _drive(args: argparse.Namespace) -> int:
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    failures = 0
    started = time.monotonic()
    for run in range(args.runs):
        root = tempfile.mkdtemp(prefix="hp-exit-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29600 + (os.getpid() + run) % 300),
               os.path.abspath(__file__), "--worker", "--variant", args.variant, "--destroy", args.destroy, "--root", root,
               "--tail", args.tail] + (["--squeeze"] if args.squeeze else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        # With --cores, each launch runs in its own directory with core dumps on (the
        # kernel's core_pattern "core" writes them to the crashing process's directory).
        cwd = Path(root) / "cwd" if args.cores else None
        if cwd is not None:
            cwd.mkdir()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=cwd,
                              preexec_fn=_core_dumps_on if args.cores else None)
        if proc.returncode != 0:
            failures += 1
            out = keep / f"{args.variant}-{args.destroy}-{args.tail}-{run}.log"
            out.write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
            print(f"run {run}: exit {proc.returncode}, log {out}", flush=True)
            for core in (cwd.glob("core*") if cwd is not None else ()):
                shutil.move(str(core), str(keep / f"{out.stem}.{core.name}"))
                print(f"  core dump {keep / f'{out.stem}.{core.name}'}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        if failures and args.stop_on_failure:
            break
    took = time.monotonic() - started
    print(f"variant={args.variant} destroy={args.destroy} tail={args.tail}: {failures} of {args.runs} runs failed "
          f"({took:.0f} s)", flush=True)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--variant", default="all", choices=["plain", "broadcast", "many_small", "manager", "all"])
    parser.add_argument("--destroy", default="no", choices=["yes", "no"])
    parser.add_argument("--root", default="")
    parser.add_argument("--squeeze", action="store_true",
                        help="pin each rank to one CPU and stop forced GIL switches (widens the race)")
    parser.add_argument("--tail", default="library", choices=["library", "torch"],
                        help="what runs last before exit: a save of the library's (no other collective "
                             "after it), or the script's own check with DTensor.full_tensor()")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--keep", default="/tmp/hp-exit-abort")
    parser.add_argument("--cores", action="store_true", help="keep core dumps of failed runs in --keep")
    parser.add_argument("--stop-on-failure", action="store_true")
    args = parser.parse_args()
    if args.worker:
        _worker(args.variant, args.destroy == "yes", args.root, args.tail, args.squeeze)
        return 0
    return _drive(args)


if __name__ == "__main__":
    sys.exit(main())
