"""End-to-end demo on CPU: ``python -m hyper_parallel_dcp``.

A tiny language model is sharded tensor-parallel over 4 gloo processes and saved
(synchronously and asynchronously); 2 processes with a different layout load both
checkpoints and check every value; the checkpoint is exported to Hugging Face
safetensors in one process and checked again.  Each phase prints its wall time.
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
        if ".out." in name or ".down." in name:
            return Shard(1)
        return Shard(0)
    # the "other" layout used for the resharded load: everything split the other way
    return Shard(1) if name != "embed.weight" else Shard(0)


def _sharded(reference: dict[str, torch.Tensor], world_size: int, layout: str, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    optim: dict[str, Any] = {}
    for name, full in reference.items():
        src = torch.zeros_like(full) if zeros else full
        model[name] = distribute_tensor(src, mesh, [_tp_placement(name, layout)])
        moment = torch.zeros_like(full, dtype=torch.float32) if zeros else full.float() * 0.5
        optim[name] = {"exp_avg": distribute_tensor(moment, mesh, [_tp_placement(name, layout)]), "step": 0 if zeros else 7}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 0.0 if zeros else 3e-4, "betas": (0.9, 0.95)}]},
            "train": {"step": 0 if zeros else 1000, "data_cursor": "" if zeros else "shard-17:offset-4096"}}


def _timed(timings: dict[str, float], name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    timings[name] = time.perf_counter() - start
    return out


def _save_worker(rank: int, world_size: int, sync_dir: str, async_dir: str) -> dict[str, float]:
    import torch.distributed as dist

    import hyper_parallel_dcp as dcp

    timings: dict[str, float] = {}
    sd = _sharded(reference_state_dict(), world_size, "tp", zeros=False)
    _timed(timings, "save (sync)", dcp.save, sd, checkpoint_id=sync_dir)
    _timed(timings, "save (sync, plan cache hit)", dcp.save, sd, checkpoint_id=sync_dir)
    first = _timed(timings, "async_save #1: blocking (starts the writer)", dcp.async_save, sd, checkpoint_id=async_dir)
    _timed(timings, "async_save #1: until landed", first.get_result, 300)
    second = _timed(timings, "async_save #2: blocking (buffers reused)", dcp.async_save, sd, checkpoint_id=async_dir)
    # training goes on here: the staged copy is independent of these tensors
    for leaf in sd["model"].values():
        leaf.to_local().zero_()
    _timed(timings, "async_save #2: until landed", second.get_result, 300)
    dist.barrier()
    return timings


def _load_worker(rank: int, world_size: int, sync_dir: str, async_dir: str) -> dict[str, float]:
    import hyper_parallel_dcp as dcp

    timings: dict[str, float] = {}
    reference = reference_state_dict()
    for label, path in (("sync", sync_dir), ("async", async_dir)):
        sd = _sharded(reference, world_size, "other", zeros=True)
        _timed(timings, f"resharded load ({label} checkpoint)", dcp.load, sd, checkpoint_id=path)
        for name, full in reference.items():
            got = sd["model"][name].full_tensor()
            if not torch.equal(got, full):
                raise AssertionError(f"{name} differs after the resharded load of the {label} checkpoint")
            if not torch.equal(sd["optim"]["state"][name]["exp_avg"].full_tensor(), full.float() * 0.5):
                raise AssertionError(f"optimizer state of {name} differs ({label} checkpoint)")
            if sd["optim"]["state"][name]["step"] != 7:
                raise AssertionError(f"optimizer step of {name} differs ({label} checkpoint)")
        if sd["train"] != {"step": 1000, "data_cursor": "shard-17:offset-4096"}:
            raise AssertionError(f"non-tensor state differs ({label} checkpoint): {sd['train']}")
        if sd["optim"]["param_groups"] != [{"lr": 3e-4, "betas": (0.9, 0.95)}]:
            raise AssertionError(f"param_groups differ ({label} checkpoint)")
    return timings


def _hf_export(sync_dir: str, hf_dir: str) -> dict[str, float]:
    from safetensors.torch import load_file

    from hyper_parallel_dcp.offline_transform import dcp_to_full_state_dict, save_state_dict_as_huggingface_format

    timings: dict[str, float] = {}
    full = _timed(timings, "DCP -> full state dict", dcp_to_full_state_dict, sync_dir)
    weights = {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}
    _timed(timings, "HF export (safetensors shards)", save_state_dict_as_huggingface_format, hf_dir, weights,
           max_shard_size="64KB")
    exported: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(hf_dir, name)))
    reference = reference_state_dict()
    if exported.keys() != reference.keys() or any(not torch.equal(exported[k], v) for k, v in reference.items()):
        raise AssertionError("the Hugging Face export differs from the model")
    timings["HF files written"] = float(len([n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel_dcp", description=__doc__.splitlines()[0])
    parser.add_argument("--save-ranks", type=int, default=4, help="processes that save (default 4)")
    parser.add_argument("--load-ranks", type=int, default=2, help="processes that load, another layout (default 2)")
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoints under DIR and keep them")
    args = parser.parse_args(argv)

    from hyper_parallel_dcp.core.testing import run_distributed

    root = args.keep or tempfile.mkdtemp(prefix="hp-dcp-demo-")
    os.makedirs(root, exist_ok=True)
    sync_dir, async_dir, hf_dir = (os.path.join(root, n) for n in ("step_1000", "step_1000_async", "hf_export"))
    params = sum(t.numel() for t in reference_state_dict().values())
    print(f"hyper-parallel-dcp demo: tiny LM, {params:,} bf16 parameters + Adam state, checkpoints under {root}")
    rows: list[tuple[str, str, float]] = []
    try:
        t0 = time.perf_counter()
        saved = run_distributed(_save_worker, args.save_ranks, sync_dir, async_dir, timeout=600)
        rows += [(f"{args.save_ranks} ranks, TP", k, max(t[k] for t in saved)) for k in saved[0]]
        loaded = run_distributed(_load_worker, args.load_ranks, sync_dir, async_dir, timeout=600)
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
    print(f"\nAll values verified equal after the resharded loads and the HF export ({files} shard files). "
          f"Total {total:.1f} s including process start-up.")
    print("Per-phase logs of the library itself: HP_LOG_CONFIG=DCP:INFO python -m hyper_parallel_dcp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
