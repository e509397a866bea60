"""Accelerator check: save / async_save / load of DTensor state living on the accelerator.

Run on a machine with a GPU (or an NPU with ``torch_npu``)::

    python tools/accelerator_check.py                 # 1 GiB dense + 2000 small tensors
    python tools/accelerator_check.py --size-mib 256  # quicker
    nox -s accelerator                                # the same, in a nox venv

It checks every value that comes back and prints, for the same bytes in the same run:

- staging (``async_save``'s blocking part, device -> pinned host) next to a plain
  ``tensor.copy_`` into a pinned host buffer and into pageable memory;
- loading into accelerator tensors (file -> host -> device) next to a plain pinned
  host -> device copy;
- a synchronous save, and the time until an async save has landed.

With two or more devices it also runs a 2-rank load of replicated state, which reads each
replicated shard once and broadcasts it over the accelerator's collective backend (NCCL on
CUDA); with one device it says that this part needs two.

``--device cpu`` runs the same flow on CPU tensors (no pinning) to check the script itself
on a machine without an accelerator. Results go to stdout and, with ``--out``, to a
Markdown file. Runs in a few minutes for the default size.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

_ROOT = Path(__file__).resolve().parents[1]


def _make_importable() -> None:
    """Use the checkout's sources when the packages are not installed (a bare GPU machine)."""
    if importlib.util.find_spec("hyper_parallel_dcp.core") is not None:
        return
    for src in [_ROOT / "src", *sorted((_ROOT / "packages").glob("*/src"))]:
        sys.path.insert(0, str(src))
    missing = [m for m in ("torch", "safetensors", "xxhash") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"accelerator_check: missing Python packages {missing}; install them first")


_make_importable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

GIB = 1024**3


def _device_type(requested: str) -> str:
    if requested != "auto":
        return requested
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None:
            return current.type
    return "none"


def _synchronize(device_type: str) -> None:
    if device_type != "cpu":
        torch.accelerator.synchronize()


def _timed(device_type: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    _synchronize(device_type)
    start = time.perf_counter()
    value = fn()
    _synchronize(device_type)
    return time.perf_counter() - start, value


def _state_dict(size_mib: int, n_small: int, mesh: DeviceMesh, device: torch.device, *,
                zeros: bool) -> dict[str, Any]:
    """Dense bf16 matrices (Shard(0) over the mesh) plus many 4 KiB tensors (replicated)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    rows = 4096
    n_dense = max(1, size_mib // 32)  # 32 MiB per bf16 matrix of 4096 x 4096
    make: Callable[..., torch.Tensor] = (
        (lambda *s: torch.zeros(*s, dtype=torch.bfloat16)) if zeros
        else (lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)))
    state: dict[str, Any] = {}
    for i in range(n_dense):
        full = make(rows, rows).to(device)
        state[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
    for i in range(n_small):
        full = make(2048).to(device)  # 4 KiB of bf16
        state[f"norms.{i}.weight"] = distribute_tensor(full, mesh, [Replicate()])
    return state


def _bytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        local = value.to_local() if isinstance(value, DTensor) else value
        total += local.numel() * local.element_size()
    return total


def _compare(loaded: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    for key, ref in reference.items():
        got = loaded[key]
        got_local = got.to_local() if isinstance(got, DTensor) else got
        ref_local = ref.to_local() if isinstance(ref, DTensor) else ref
        if got_local.device != ref_local.device:
            raise AssertionError(f"{what}: {key} came back on {got_local.device}, expected {ref_local.device}")
        if not torch.equal(got_local, ref_local):
            raise AssertionError(f"{what}: {key} differs from what was saved")


def _reference_copies(device_type: str, nbytes: int, device: torch.device) -> dict[str, float]:
    """GB/s of plain copies of ``nbytes``: device -> pinned / pageable host, pinned host -> device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    rates: dict[str, float] = {}
    if device_type == "cpu":
        seconds, _ = _timed(device_type, lambda: pageable.copy_(src))
        rates["copy_to_host_pageable"] = nbytes / seconds / 1e9
        return rates
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(src)  # warm up (first-touch of the host pages)
    pageable.copy_(src)
    seconds, _ = _timed(device_type, lambda: pinned.copy_(src, non_blocking=True))
    rates["copy_to_host_pinned"] = nbytes / seconds / 1e9
    seconds, _ = _timed(device_type, lambda: pageable.copy_(src))
    rates["copy_to_host_pageable"] = nbytes / seconds / 1e9
    seconds, _ = _timed(device_type, lambda: src.copy_(pinned, non_blocking=True))
    rates["copy_from_host_pinned"] = nbytes / seconds / 1e9
    return rates


def _init(rank: int, world_size: int, store_path: str, device_type: str) -> tuple[DeviceMesh, torch.device]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device_type == "cpu":
        backend, device = "gloo", torch.device("cpu")
    else:
        torch.accelerator.set_device_index(rank)
        device = torch.device(device_type, rank)
        accelerator_backend = dist.get_default_backend_for_device(device_type)
        backend = f"cpu:gloo,{device_type}:{accelerator_backend}"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    return DeviceMesh(device.type, list(range(world_size))), device


def _single_device(args: argparse.Namespace, device_type: str, workdir: str) -> dict[str, Any]:
    import hyper_parallel_dcp as hp_dcp

    mesh, device = _init(0, 1, os.path.join(workdir, "store1"), device_type)
    try:
        state = _state_dict(args.size_mib, args.small, mesh, device, zeros=False)
        nbytes = _bytes(state)
        report: dict[str, Any] = {"device": str(device), "bytes": nbytes, "tensors": len(state)}
        if device_type != "cpu":
            report["device_name"] = torch.cuda.get_device_name(device) if device_type == "cuda" else device_type
        report.update(_reference_copies(device_type, nbytes, device))

        sync_dir = os.path.join(workdir, "sync")
        seconds, _ = _timed(device_type, lambda: hp_dcp.save(state, checkpoint_id=sync_dir))
        report["save_s"] = seconds

        saved = {"load": {k: v.clone() for k, v in state.items()}}
        # the writer started and ready ahead, as CheckpointManager(async_save=True) does:
        # "first" times staging into new pinned buffers, not a Python process starting
        from hyper_parallel_dcp.async_persist import start_writer

        start_writer(wait=True, timeout=600)
        for attempt in ("first", "later"):
            if attempt == "later":
                # New values on the device: a later save that returned before its non_blocking
                # device -> pinned copies finished would land the first save's bytes.
                for value in state.values():
                    value.to_local().add_(1)
            expected = {k: v.clone() for k, v in state.items()}
            async_dir = os.path.join(workdir, f"async_{attempt}")
            start = time.perf_counter()
            response = hp_dcp.async_save(state, checkpoint_id=async_dir)
            blocking = time.perf_counter() - start
            for value in state.values():  # training goes on: staging must own its bytes
                value.to_local().zero_()
            response.get_result(timeout=600)
            report[f"async_{attempt}_blocking_s"] = blocking
            report[f"async_{attempt}_landed_s"] = time.perf_counter() - start
            report[f"async_{attempt}_staging_gbps"] = nbytes / blocking / 1e9
            for key, value in expected.items():
                state[key].to_local().copy_(value.to_local())
            saved["load_async"] = expected

        for name, path in (("load", sync_dir), ("load_async", os.path.join(workdir, "async_later"))):
            target = _state_dict(args.size_mib, args.small, mesh, device, zeros=True)
            # page cache warm for both: the read is not what is measured, the H2D path is
            seconds, _ = _timed(device_type, functools.partial(hp_dcp.load, target, checkpoint_id=path))
            _compare(target, saved[name], name)
            report[f"{name}_s"] = seconds
            report[f"{name}_gbps"] = nbytes / seconds / 1e9
        return report
    finally:
        dist.destroy_process_group()


def _broadcast_worker(rank: int, world_size: int, store_path: str, device_type: str, ckpt: str,
                      size_mib: int, n_small: int, results: Any) -> None:
    import hyper_parallel_dcp as hp_dcp

    mesh, device = _init(rank, world_size, store_path, device_type)
    try:
        reference = _state_dict(size_mib, n_small, mesh, device, zeros=False)
        hp_dcp.save(reference, checkpoint_id=ckpt)
        replicated = {k: distribute_tensor(v.full_tensor(), mesh, [Replicate()]) for k, v in reference.items()}
        target = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, [Replicate()]) for k, v in reference.items()}
        seconds, _ = _timed(device_type, lambda: hp_dcp.load(target, checkpoint_id=ckpt))
        _compare(target, replicated, f"broadcast load on rank {rank}")
        results.put((rank, seconds))
    finally:
        dist.destroy_process_group()


def _broadcast_load(args: argparse.Namespace, device_type: str, workdir: str) -> dict[str, Any]:
    count = torch.accelerator.device_count() if device_type != "cpu" else 2
    if count < 2:
        return {"broadcast": f"skipped: read-once + broadcast over the device backend needs 2 devices, {count} present"}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(workdir, "store2")
    ckpt = os.path.join(workdir, "bcast")
    procs = [ctx.Process(target=_broadcast_worker,
                         args=(r, 2, store, device_type, ckpt, max(32, args.size_mib // 4), args.small // 4, results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"broadcast load failed: exit codes {[p.exitcode for p in procs]}")
    seconds = max(results.get()[1] for _ in procs)
    return {"broadcast_load_2ranks_s": seconds}


def _markdown(report: dict[str, Any]) -> str:
    gib = report["bytes"] / GIB
    lines = [
        f"# Accelerator check — {report.get('device_name', report['device'])}",
        "",
        f"{report['tensors']} tensors, {gib:.2f} GiB, one device; every loaded value compared with what was saved.",
        "",
        "| figure | seconds | GB/s | reference (plain copy, GB/s) |",
        "|---|---|---|---|",
    ]
    if "copy_to_host_pinned" in report:
        to_host = f"{report['copy_to_host_pinned']:.2f} (device → pinned host)"
        from_host = f"{report['copy_from_host_pinned']:.2f} (pinned host → device)"
    else:  # --device cpu: a plain memory copy is the only reference
        to_host = from_host = f"{report['copy_to_host_pageable']:.2f} (memory copy)"
    for attempt in ("first", "later"):
        lines.append(f"| async_save staging ({attempt} save, blocking) | {report[f'async_{attempt}_blocking_s']:.3f} | "
                     f"{report[f'async_{attempt}_staging_gbps']:.2f} | {to_host} |")
        lines.append(f"| async_save until landed ({attempt}) | {report[f'async_{attempt}_landed_s']:.3f} | | |")
    lines.append(f"| save (sync) | {report['save_s']:.3f} | {report['bytes'] / report['save_s'] / 1e9:.2f} | "
                 f"{report['copy_to_host_pageable']:.2f} (device → pageable host) |")
    for name in ("load", "load_async"):
        lines.append(f"| {name.replace('_', ' ')} into device tensors (page cache warm) | {report[f'{name}_s']:.3f} | "
                     f"{report[f'{name}_gbps']:.2f} | {from_host} |")
    if "broadcast_load_2ranks_s" in report:
        lines.append(f"| replicated load, 2 ranks, read once + broadcast | {report['broadcast_load_2ranks_s']:.3f} | | |")
    else:
        lines.append(f"\n{report.get('broadcast', '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="dense bytes (bf16 4096x4096 matrices)")
    parser.add_argument("--small", type=int, default=2000, help="number of 4 KiB tensors")
    parser.add_argument("--device", default="auto", help="auto (the accelerator), or a device type such as cpu")
    parser.add_argument("--out", type=Path, help="write the Markdown report here (and JSON beside it)")
    args = parser.parse_args(argv)
    device_type = _device_type(args.device)
    if device_type == "none":
        print("accelerator_check: no accelerator on this machine (torch.accelerator finds none); "
              "use --device cpu to check the script itself")
        return 0
    with tempfile.TemporaryDirectory(prefix="hp-dcp-accel-") as workdir:
        report = _single_device(args, device_type, workdir)
        report.update(_broadcast_load(args, device_type, workdir))
    text = _markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
