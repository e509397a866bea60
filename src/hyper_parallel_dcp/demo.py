"""End-to-end demo on CPU: ``python -m hyper_parallel_dcp``.

A tiny language model, tensor-parallel over 4 gloo processes, trains and checkpoints through
:class:`CheckpointManager`, sync and async; 2 processes with another layout restore and check
every value; the weights go to Hugging Face safetensors and are checked again.  ``--keep DIR``
keeps the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

__all__ = ["main", "reference_state_dict"]

VOCAB, DIM, LAYERS, FFN = 512, 64, 2, 256


def reference_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights and Adam-like state of the tiny model, deterministic."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    sd: dict[str, torch.Tensor] = {"embed.weight": rand(VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = rand(3 * DIM, DIM)
        sd[p + "attn.out.weight"] = rand(DIM, DIM)
        sd[p + "mlp.up.weight"] = rand(FFN, DIM)
        sd[p + "mlp.down.weight"] = rand(DIM, FFN)
        sd[p + "norm.weight"] = rand(DIM)
    sd["norm.weight"] = rand(DIM)
    return sd


def _tp_placement(name: str, layout: str) -> Any:
    """Column-parallel / row-parallel / replicated, as Megatron-style TP shards a model."""
    from torch.distributed.tensor import Replicate, Shard

    if name.endswith("norm.weight"):
        return Replicate()
    if layout == "tp":
        return Shard(1) if ".out." in name or ".down." in name else Shard(0)
    return Shard(1) if name != "embed.weight" else Shard(0)  # "other", the resharded load's: the other way


def _sharded(reference: dict[str, torch.Tensor], world_size: int, layout: str, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    optim: dict[str, Any] = {}
    for name, full in reference.items():
        placements = [_tp_placement(name, layout)]
        model[name] = distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, placements)
        moment = torch.zeros_like(full, dtype=torch.float32) if zeros else full.float() * 0.5
        optim[name] = {"exp_avg": distribute_tensor(moment, mesh, placements), "step": 0 if zeros else 7}
    param_groups = [{"lr": 0.0 if zeros else 3e-4, "betas": (0.9, 0.95)}]
    return {"model": model, "optim": {"state": optim, "param_groups": param_groups},
            "train": {"step": 0 if zeros else 1000, "data_cursor": "" if zeros else "shard-17:offset-4096"}}


def _timed(timings: dict[str, float], name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    timings[name] = time.perf_counter() - start
    return out


#: The demo's training loop: steps 1..TRAIN_STEPS, a checkpoint every SAVE_EVERY, the last KEEP kept.
TRAIN_STEPS, SAVE_EVERY, KEEP = 1000, 250, 2


def _train_worker(rank: int, world_size: int, sync_root: str, async_root: str) -> dict[str, float]:
    """Two training loops (sync, then async) through a CheckpointManager; the slowest save times."""
    import hyper_parallel_dcp as dcp

    reference = reference_state_dict()
    timings: dict[str, float] = {}
    for label, root, use_async in (("sync", sync_root, False), ("async", async_root, True)):
        sd = _sharded(reference, world_size, "tp", zeros=False)
        shards = {name: leaf.to_local() for name, leaf in sd["model"].items()}
        trained = {name: shard.clone() for name, shard in shards.items()}
        with dcp.CheckpointManager(root, keep_last=KEEP, save_interval_steps=SAVE_EVERY,
                                   async_save=use_async) as mgr:
            saves = 0
            for step in range(1, TRAIN_STEPS + 1):
                # (forward, backward and optimizer step here; the weights stay the reference's)
                if use_async and step % SAVE_EVERY == 0:
                    for name, shard in shards.items():
                        shard.copy_(trained[name])
                sd["train"]["step"] = step
                start = time.perf_counter()
                if not mgr.save(step, sd, metrics={"loss": 1.0 / step}):
                    continue
                blocked = time.perf_counter() - start
                saves += 1
                kind = (f"save #1 (plans{', starts the writer' if use_async else ''})" if saves == 1
                        else "save, later (plan cache)")
                _slowest(timings, f"{label} {kind}: blocks training", blocked)
                if use_async:  # the staged copy is independent of these tensors: they may change at once
                    for shard in shards.values():
                        shard.zero_()
                    mgr.wait()
                    _slowest(timings, f"{label} {kind}: landed after", time.perf_counter() - start)
            kept = mgr.all_steps()
        expected = list(range(SAVE_EVERY, TRAIN_STEPS + 1, SAVE_EVERY))[-KEEP:]
        if kept != expected:
            raise AssertionError(f"{label} run kept steps {kept}, expected {expected}")
    return timings


def _slowest(timings: dict[str, float], name: str, seconds: float) -> None:
    timings[name] = max(timings.get(name, 0.0), seconds)


def _load_worker(rank: int, world_size: int, sync_root: str, async_root: str) -> dict[str, float]:
    import hyper_parallel_dcp as dcp

    timings: dict[str, float] = {}
    reference = reference_state_dict()
    for label, root in (("sync", sync_root), ("async", async_root)):
        sd = _sharded(reference, world_size, "other", zeros=True)
        with dcp.CheckpointManager(root) as mgr:
            step = _timed(timings, f"restore newest, resharded ({label} run)", mgr.restore, sd)
        if step != TRAIN_STEPS:
            raise AssertionError(f"restore of the {label} run picked step {step}, expected {TRAIN_STEPS}")
        for name, full in reference.items():
            if not torch.equal(sd["model"][name].full_tensor(), full):
                raise AssertionError(f"{name} differs after the resharded restore of the {label} run")
            if not torch.equal(sd["optim"]["state"][name]["exp_avg"].full_tensor(), full.float() * 0.5):
                raise AssertionError(f"optimizer state of {name} differs ({label} run)")
            if sd["optim"]["state"][name]["step"] != 7:
                raise AssertionError(f"optimizer step of {name} differs ({label} run)")
        if sd["train"] != {"step": TRAIN_STEPS, "data_cursor": "shard-17:offset-4096"}:
            raise AssertionError(f"non-tensor state differs ({label} run): {sd['train']}")
        if sd["optim"]["param_groups"] != [{"lr": 3e-4, "betas": (0.9, 0.95)}]:
            raise AssertionError(f"param_groups differ ({label} run)")
    return timings


def _hf_export(sync_dir: str, hf_dir: str) -> dict[str, float]:
    from safetensors.torch import load_file

    from hyper_parallel_dcp.offline_transform import convert_dcp_to_huggingface

    timings: dict[str, float] = {}
    # what `hp-dcp-convert dcp-to-hf` does with a trainer checkpoint: the model's weights, 'model.' stripped
    _timed(timings, "HF export of the model (streaming, shards)", convert_dcp_to_huggingface, sync_dir, hf_dir,
           "64KB", model_only=True)
    files = sorted(name for name in os.listdir(hf_dir) if name.endswith(".safetensors"))
    exported = {k: v for name in files for k, v in load_file(os.path.join(hf_dir, name)).items()}
    reference = reference_state_dict()
    if exported.keys() != reference.keys() or any(not torch.equal(exported[k], v) for k, v in reference.items()):
        raise AssertionError("the Hugging Face export differs from the model")
    timings["HF files written"] = float(len(files))
    return timings


#: Marks a ``--keep`` directory as the demo's, so that a second run may replace what it holds.
_MARKER = ".hp-dcp-demo"


def _prepare_keep_dir(root: str) -> bool:
    """Make ``root`` an empty directory of the demo's; False (said why) when it holds other files."""
    if os.path.isdir(root) and os.listdir(root):
        if not os.path.isfile(os.path.join(root, _MARKER)):
            print(f"--keep {root}: the directory is not empty and holds no earlier demo run; pass a new or empty "
                  "directory", file=sys.stderr)
            return False
        print(f"replacing the checkpoints of an earlier demo run in {root}")
        shutil.rmtree(root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, _MARKER), "w") as f:
        f.write("checkpoints written by python -m hyper_parallel_dcp --keep\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel_dcp", description=__doc__.splitlines()[0])
    parser.add_argument("--save-ranks", type=int, default=4, help="processes that save (default 4)")
    parser.add_argument("--load-ranks", type=int, default=2, help="processes that load, another layout (default 2)")
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoints under DIR and keep them")
    args = parser.parse_args(argv)

    from hyper_parallel_dcp.core.testing import run_distributed

    root = args.keep or tempfile.mkdtemp(prefix="hp-dcp-demo-")
    if args.keep and not _prepare_keep_dir(root):
        return 2
    # The sync run's steps live in root itself (root/step_1000); the async run and the HF export
    # are directories of the user's in that root, which retention leaves alone.
    sync_root, async_root, hf_dir = root, os.path.join(root, "async_run"), os.path.join(root, "hf_export")
    sync_dir = os.path.join(sync_root, f"step_{TRAIN_STEPS}")
    params = sum(t.numel() for t in reference_state_dict().values())
    print(f"hyper-parallel-dcp demo: tiny LM, {params:,} bf16 parameters + Adam state, checkpoints under {root}")
    rows: list[tuple[str, str, float]] = []
    try:
        t0 = time.perf_counter()
        saved = run_distributed(_train_worker, args.save_ranks, sync_root, async_root, timeout=600)
        rows += [(f"{args.save_ranks} ranks, TP", k, max(t[k] for t in saved)) for k in saved[0]]
        loaded = run_distributed(_load_worker, args.load_ranks, sync_root, async_root, timeout=600)
        rows += [(f"{args.load_ranks} ranks, resharded", k, max(t[k] for t in loaded)) for k in loaded[0]]
        exported = _hf_export(sync_dir, hf_dir)
        files = int(exported.pop("HF files written"))
        rows += [("1 process", k, v) for k, v in exported.items()]
        total = time.perf_counter() - t0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    width = max(len(r[1]) for r in rows)
    print(f"\n{'where':<22} {'phase':<{width}}  seconds (slowest rank)")
    for where, phase, seconds in rows:
        print(f"{where:<22} {phase:<{width}}  {seconds:8.4f}")
    print(f"\nTraining loops saved every {SAVE_EVERY} steps up to {TRAIN_STEPS}, kept the last {KEEP}; all values "
          f"verified equal after the resharded restores and the HF export ({files} shard files). "
          f"Total {total:.1f} s including process start-up.")
    if args.keep:
        print(f"The checkpoints are kept in {root}: the sync run's steps in {root}/step_N, the async run's in "
              f"{async_root}/step_N, the Hugging Face export in {hf_dir}.\n"
              f"Look at them:  hp-dcp ls {root}   hp-dcp latest {root}   hp-dcp inspect {sync_dir}")
    else:
        print(f"The checkpoints under {root} were removed; to keep them: python -m hyper_parallel_dcp --keep DIR")
    print("Per-phase logs of the library itself: HP_LOG_CONFIG=DCP:INFO python -m hyper_parallel_dcp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
