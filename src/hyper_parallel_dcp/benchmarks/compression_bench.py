"""The ``compression`` section (SPEC §14, issue 59 part 2): lossless codecs on real training state.

A small MLP is trained for a few Adam steps in the benchmark itself; its weights (cast to
bf16) and its fp32 Adam moments are compressed by:

- ``byte-planes+zstd``: ``save(compression="zstd")``'s codec (``storage_fs.compression``:
  sign bit rotated next to the mantissa, byte planes by element width, zstd's fast strategy
  in 4 MiB frames), a tensor per thread;
- ``zstd`` : torch DCP's ``stream.zstd`` extension (``ZStandard``, one stream per tensor);
- ``zipnn``: the ZipNN package (its own byte grouping, zstd/Huffman).

Each gives the compressed share of the bytes and compress / decompress MB/s (median of
``reps``, the codecs interleaved), checked bit-exact (outside the timing).  Then the trained state (weights and
moments) is saved and loaded through the checkpoint, compressed and not, under the shared
bandwidth cap of ``throttle`` (``cap_mb_s``): a load's reads and a save's data-file writes
pass the cap as they happen (``ThrottledFileSystemReader`` / ``ThrottledFileSystemWriter``),
so a compressed save's later chunks compress while its earlier ones are on the link, as
they would on a real one.  Needs the bench-only packages ``zstandard`` and ``zipnn``;
without them the section says so.  Exports :func:`run_compression`.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["run_compression"]


def _trained_state(hidden: int, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(4 * hidden, hidden), torch.nn.LayerNorm(hidden),
                                torch.nn.Linear(hidden, hidden))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(64, hidden, generator=g)
        loss = ((model(x) - x.roll(1, dims=1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    moments = {f"{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items() if k != "step"}
    return {"bf16 weights": {k: v.detach().bfloat16() for k, v in model.state_dict().items()},
            "fp32 Adam moments": moments}


def _checkpoint_codec(zstandard: Any, pool: cf.ThreadPoolExecutor) -> tuple[Callable, Callable]:
    """``storage_fs.compression`` as a save and a load run it: a chunk per thread to compress,
    chunks one after another to decompress."""
    from hyper_parallel_dcp.storage_fs.compression import decode_span, encode_chunk

    def compress(tensors: list[torch.Tensor]) -> list[bytes]:
        return list(pool.map(lambda t: encode_chunk(t.contiguous().view(-1).view(torch.uint8), t.element_size(),
                                                    zstandard), tensors))

    def decompress(blobs: list[bytes], tensors: list[torch.Tensor]) -> list[bytes]:
        def one(args: tuple[bytes, torch.Tensor]) -> bytes:
            blob, t = args
            return decode_span(lambda at, n: memoryview(blob)[at:at + n], 0, t.numel() * t.element_size(), t.element_size(),
                               zstandard, lambda: "benchmark")[0]  # type: ignore[return-value]
        # as a load runs it: one chunk after another, each chunk's frames on threads (a chunk
        # per thread on top of that put 3 threads on 2 cores: bf16 1247-1491 MB/s quiet, 2322
        # one chunk at a time, same code)
        return list(map(one, zip(blobs, tensors)))

    return compress, decompress


def _torch_zstd_codec() -> tuple[Callable, Callable]:
    from torch.distributed.checkpoint._extension import ZStandard

    ext = ZStandard()

    def compress(tensors: list[torch.Tensor]) -> list[bytes]:
        out = []
        for t in tensors:
            buf = io.BytesIO()
            writer = ext.transform_to(buf)
            writer.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            writer.flush()
            out.append(buf.getvalue())
        return out

    def decompress(blobs: list[bytes], tensors: list[torch.Tensor]) -> list[bytes]:
        return [ext.transform_from(io.BytesIO(b)).read() for b in blobs]

    return compress, decompress


def _zipnn_codec(zipnn: Any, dtype_name: str) -> tuple[Callable, Callable]:
    codec = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype_name, threads=os.cpu_count() or 1)

    def compress(tensors: list[torch.Tensor]) -> list[bytes]:
        return [codec.compress(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for t in tensors]

    def decompress(blobs: list[bytes], tensors: list[torch.Tensor]) -> list[bytes]:
        return [codec.decompress(b) for b in blobs]

    return compress, decompress


def _size(blobs: list[bytes]) -> int:
    return sum(map(len, blobs))


def _throttled_checkpoints(states: dict[str, dict[str, torch.Tensor]], root: Path, cap_mb_s: float, reps: int,
                           log: Callable[[str], None]) -> dict[str, Any]:
    """Save and load of the trained state, plain and compressed, under the shared cap."""
    import hyper_parallel_dcp as dcp

    from .throttle import SharedBandwidth, ThrottledFileSystemReader, ThrottledFileSystemWriter

    state = {what.split()[1]: tensors for what, tensors in states.items()}  # "weights", "Adam"
    root.mkdir(parents=True, exist_ok=True)
    bandwidth = SharedBandwidth(root / "link", cap_mb_s * 1e6)
    out: dict[str, Any] = {"cap_mb_s": cap_mb_s}
    runs: dict[str, tuple[list[float], list[float]]] = {"plain": ([], []), "zstd": ([], [])}
    for _ in range(reps):  # the two interleaved: a shared machine's load falls on both alike
        for key, (saves, loads) in runs.items():
            compression = None if key == "plain" else key
            path = root / f"ckpt-{key}"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            md = dcp.save(state, storage_writer=ThrottledFileSystemWriter(path, bandwidth), no_dist=True,
                          compression=compression)
            saves.append(time.perf_counter() - t0)
            target = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=ThrottledFileSystemReader(path, bandwidth), no_dist=True)
            loads.append(time.perf_counter() - t0)
            exact = all(torch.equal(target[k][n], t) for k, v in state.items() for n, t in v.items())
            out[key] = {"bytes": sum(md.files.values()), "save_s": statistics.median(saves), "save_s_all": saves,
                        "load_s": statistics.median(loads), "load_s_all": loads,
                        "bit_exact": exact and out.get(key, {}).get("bit_exact", True)}
    for key, (saves, loads) in runs.items():
        log(f"compression: {key} checkpoint of the trained state under {cap_mb_s:g} MB/s: {out[key]['bytes']} B, "
            f"save {out[key]['save_s']:.3f}s ({min(saves):.3f}-{max(saves):.3f}), load {out[key]['load_s']:.3f}s "
            f"({min(loads):.3f}-{max(loads):.3f}), bit-exact {out[key]['bit_exact']}")
    shutil.rmtree(root, ignore_errors=True)
    out["save_speedup"] = out["plain"]["save_s"] / out["zstd"]["save_s"]
    out["load_speedup"] = out["plain"]["load_s"] / out["zstd"]["load_s"]
    return out


def run_compression(hidden: int, steps: int, reps: int, log: Callable[[str], None], root: Optional[Path] = None,
                    cap_mb_s: float = 200.0) -> dict[str, Any]:
    """Each codec on the trained state's weights and moments; ``{"status"}`` without the packages."""
    try:
        import zipnn
        import zstandard
    except ImportError as exc:
        return {"status": f"not measured: {exc.name} is not installed (bench-only: pip install zstandard zipnn)"}
    from hyper_parallel_dcp.storage_fs.compression import FRAME_BYTES

    states = _trained_state(hidden, steps)
    out: dict[str, Any] = {"hidden": hidden, "steps": steps, "frame_bytes": FRAME_BYTES, "threads": os.cpu_count(),
                           "rows": []}
    with cf.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for what, tensors_by_name in states.items():
            tensors = list(tensors_by_name.values())
            raw = sum(t.numel() * t.element_size() for t in tensors)
            expected = [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
            dtype_name = "bfloat16" if tensors[0].dtype == torch.bfloat16 else "float32"
            codecs = {"byte-planes+zstd": _checkpoint_codec(zstandard, pool), "zstd (torch DCP)": _torch_zstd_codec(),
                      "zipnn": _zipnn_codec(zipnn, dtype_name)}
            sizes: dict[str, int] = {}
            times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in codecs}
            exact: dict[str, bool] = {}
            for _ in range(reps):  # the codecs interleaved: a shared machine's load falls on each alike
                for name, (compress, decompress) in codecs.items():
                    t0 = time.perf_counter()
                    blobs = compress(tensors)
                    times[name][0].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    back = decompress(blobs, tensors)
                    times[name][1].append(time.perf_counter() - t0)
                    exact[name] = exact.get(name, True) and [bytes(b) for b in back] == expected
                    sizes[name] = _size(blobs)
            for name, (c_times, d_times) in times.items():
                row: dict[str, Any] = {"data": what, "codec": name, "raw_bytes": raw, "compressed_bytes": sizes[name],
                       "share": sizes[name] / raw, "compress_mb_s": raw / 1e6 / statistics.median(c_times),
                       "decompress_mb_s": raw / 1e6 / statistics.median(d_times), "bit_exact": exact[name],
                       "compress_mb_s_all": [raw / 1e6 / t for t in c_times],
                       "decompress_mb_s_all": [raw / 1e6 / t for t in d_times]}
                out["rows"].append(row)
                log(f"compression {what}, {name}: {100 * row['share']:.1f} % of {raw} B, compress "
                    f"{row['compress_mb_s']:.0f} MB/s ({raw / 1e6 / max(c_times):.0f}-{raw / 1e6 / min(c_times):.0f}), "
                    f"decompress {row['decompress_mb_s']:.0f} MB/s ({raw / 1e6 / max(d_times):.0f}-"
                    f"{raw / 1e6 / min(d_times):.0f}), bit-exact {exact[name]}")
    if root is not None:
        out["throttled"] = _throttled_checkpoints(states, root, cap_mb_s, reps, log)
    return out
