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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

_ROOT = Path(__file__).resolve().parents[1]


def _make_importable() -> None:
    """Use the checkout's sources when the packages are not installed (a bare GPU machine)."""
    try:
        if importlib.util.find_spec("hyper_parallel_dcp.core") is not None:
            return
    except ModuleNotFoundError:  # not even the umbrella package is installed
        pass
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


def _fresh_copy_s(device_type: str, state: dict[str, Any]) -> float:
    """Seconds of ``local.to("cpu")`` of every tensor into new memory: what a first save
    without staging buffers would block for (the first async save's reference)."""
    seconds, copies = _timed(device_type, lambda: [v.to_local().to("cpu", copy=True) for v in state.values()])
    del copies
    return seconds


def _raw_write_s(nbytes: int, workdir: str) -> float:
    """Seconds to write and fsync ``nbytes`` from host memory into one new file."""
    data = torch.ones(nbytes, dtype=torch.uint8).numpy().data
    path = os.path.join(workdir, "raw.bin")
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for at in range(0, nbytes, 64 << 20):
            f.write(data[at:at + (64 << 20)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def _raw_read_s(device_type: str, checkpoint: str, device: torch.device) -> float:
    """Seconds to read a checkpoint's files (page cache warm, one thread) into pinned
    host memory and copy them to the device: the load's floor, without any library."""
    files = [os.path.join(checkpoint, name) for name in sorted(os.listdir(checkpoint))
             if not name.startswith(".")]
    size = max(os.path.getsize(f) for f in files)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device_type != "cpu")
    target = torch.empty(size, dtype=torch.uint8, device=device)
    buffer = pinned.numpy().data

    def run() -> None:
        for name in files:
            n = os.path.getsize(name)
            with open(name, "rb", buffering=0) as f:
                done = 0
                while done < n:
                    done += f.readinto(buffer[done:n])
            target[:n].copy_(pinned[:n], non_blocking=True)
            _synchronize(device_type)

    run()  # the page cache warm, as for the measured loads
    seconds, _ = _timed(device_type, run)
    return seconds


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
        report["environment"] = (f"{time.strftime('%Y-%m-%d')}: torch {torch.__version__}, Python "
                                 f"{sys.version.split()[0]}, {os.cpu_count()} CPUs.")
        if device_type != "cpu":
            report["device_name"] = torch.cuda.get_device_name(device) if device_type == "cuda" else device_type
        report.update(_reference_copies(device_type, nbytes, device))

        report["fresh_copy_s"] = _fresh_copy_s(device_type, state)
        report["raw_write_s"] = _raw_write_s(nbytes, workdir)
        sync_dir = os.path.join(workdir, "sync")
        seconds, _ = _timed(device_type, lambda: hp_dcp.save(state, checkpoint_id=sync_dir))
        report["save_s"] = seconds
        report["raw_read_s"] = _raw_read_s(device_type, sync_dir, device)

        saved = {"load": {k: v.clone() for k, v in state.items()}}
        # the writer started and ready ahead, as CheckpointManager(async_save=True) does:
        # "first" times staging into new pinned buffers, not a Python process starting
        from hyper_parallel_dcp.async_persist import start_writer

        start_writer(wait=True, timeout=600)
        samples: dict[str, list[tuple[float, float]]] = {"first": [], "later": []}
        # three later saves: one sample of tens of milliseconds varied by half on the H200 VM
        for attempt in ("first", "later", "later", "later"):
            if attempt == "later":
                # New values on the device: a later save that returned before its non_blocking
                # device -> pinned copies finished would land the first save's bytes.
                for value in state.values():
                    value.to_local().add_(1)
            expected = {k: v.clone() for k, v in state.items()}
            async_dir = os.path.join(workdir, f"async_{attempt}")
            # the 4000 small kernels just queued (add_, clone) are not the save's to wait for
            _synchronize(device_type)
            start = time.perf_counter()
            response = hp_dcp.async_save(state, checkpoint_id=async_dir)
            blocking = time.perf_counter() - start
            for value in state.values():  # training goes on: staging must own its bytes
                value.to_local().zero_()
            response.get_result(timeout=600)
            samples[attempt].append((blocking, time.perf_counter() - start))
            for key, value in expected.items():
                state[key].to_local().copy_(value.to_local())
            saved["load_async"] = expected
        for attempt, taken in samples.items():
            blocking, landed = (statistics.median(column) for column in zip(*taken))
            report[f"async_{attempt}_blocking_s"] = blocking
            report[f"async_{attempt}_landed_s"] = landed
            report[f"async_{attempt}_staging_gbps"] = nbytes / blocking / 1e9
        report["async_later_blocking_all_s"] = [b for b, _ in samples["later"]]

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
    nbytes = report["bytes"]
    lines = [
        f"# Accelerator check — {report.get('device_name', report['device'])}",
        "",
        f"{report['tensors']} tensors, {gib:.2f} GiB, one device; every loaded value compared with what was saved.",
        f"{report.get('environment', '')}",
        "Each figure is one run, next to a reference measured in the same run (the last column: "
        "the figure's seconds over the reference's).",
        "",
        "| figure | seconds | GB/s | reference | reference seconds | ratio |",
        "|---|---|---|---|---|---|",
    ]
    pinned = "copy_to_host_pinned" in report

    def row(figure: str, seconds: float, reference: str = "", ref_seconds: Optional[float] = None) -> None:
        ratio = f"{seconds / ref_seconds:.2f}×" if ref_seconds else ""
        ref_text = f"{ref_seconds:.3f}" if ref_seconds else ""
        lines.append(f"| {figure} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | {reference} | {ref_text} | {ratio} |")

    to_host_s = nbytes / (report["copy_to_host_pinned"] if pinned else report["copy_to_host_pageable"]) / 1e9
    from_host_s = nbytes / (report["copy_from_host_pinned"] if pinned else report["copy_to_host_pageable"]) / 1e9
    to_host = "one device → pinned host copy" if pinned else "one memory copy"
    row("async_save blocking, first save", report["async_first_blocking_s"], "a fresh host copy of every tensor",
        report["fresh_copy_s"])
    row("async_save blocking, later save (median of 3)", report["async_later_blocking_s"], to_host, to_host_s)
    row("async_save until landed, first", report["async_first_landed_s"], "raw write + fsync", report["raw_write_s"])
    row("async_save until landed, later (median of 3)", report["async_later_landed_s"], "raw write + fsync",
        report["raw_write_s"])
    row("save (sync)", report["save_s"], "raw write + fsync", report["raw_write_s"])
    for name in ("load", "load_async"):
        row(f"{name.replace('_', ' ')} into device tensors (page cache warm)", report[f"{name}_s"],
            "raw read into pinned host + copy to device", report["raw_read_s"])
    lines.append("")
    lines.append(f"Plain copies of the same bytes: device → pinned host {to_host_s:.3f} s, pinned host → device "
                 f"{from_host_s:.3f} s, device → pageable host {nbytes / report['copy_to_host_pageable'] / 1e9:.3f} s.")
    if "broadcast_load_2ranks_s" in report:
        lines.append(f"Replicated load, 2 ranks, read once + broadcast: {report['broadcast_load_2ranks_s']:.3f} s.")
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
