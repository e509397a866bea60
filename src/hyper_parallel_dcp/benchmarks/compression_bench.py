"""The ``compression`` section (SPEC §14, issue 59 part 2): lossless codecs on real training state.

A small MLP is trained for a few Adam steps in the benchmark itself; its weights (cast to
bf16) and its fp32 Adam moments are compressed by:

- ``byte-planes+zstd``: the planned checkpoint codec, measured here before it is wired
  into ``save``: each tensor's bytes split into byte planes by element width, zstd level
  1 per plane in frames of :data:`FRAME_BYTES` raw bytes (a partial load would decompress only
  the frames it touches), a plane that does not shrink stored raw, frames on a thread pool;
- ``zstd`` : torch DCP's ``stream.zstd`` extension (``ZStandard``, one stream per tensor);
- ``zipnn``: the ZipNN package (its own byte grouping, zstd/Huffman).

Each gives the compressed share of the bytes and compress / decompress MB/s (median of
``reps``), checked bit-exact.  Needs the bench-only packages ``zstandard`` and ``zipnn``;
without them the section says so.  Exports :func:`run_compression`.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["FRAME_BYTES", "run_compression"]

#: raw bytes per zstd frame of the planned codec
FRAME_BYTES = 4 << 20


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


#: a plane whose first :data:`_PROBE` bytes do not shrink below this share is stored raw (the
#: low mantissa bytes are noise: compressing them costs time and saves nothing)
_RAW_ABOVE, _PROBE = 0.9, 64 << 10


def _byte_planes_codec(zstandard: Any, pool: cf.ThreadPoolExecutor) -> tuple[Callable, Callable]:
    """Frame = per byte plane ``(stored raw?, bytes)``; frames compressed on ``pool``."""

    def frames(t: torch.Tensor) -> list[torch.Tensor]:
        raw = t.contiguous().view(-1).view(torch.uint8)
        width = t.element_size()
        step = FRAME_BYTES - FRAME_BYTES % width
        return [raw[i:i + step].view(-1, width).t().contiguous() for i in range(0, raw.numel(), step)]

    def one(planes: torch.Tensor) -> list[tuple[bool, bytes]]:
        zc = zstandard.ZstdCompressor(level=1)
        out = []
        for plane in planes.numpy():
            probe = plane[:_PROBE]
            if len(zc.compress(probe)) > _RAW_ABOVE * len(probe):
                out.append((True, plane.tobytes()))
            else:
                out.append((False, zc.compress(plane)))
        return out

    def compress(tensors: list[torch.Tensor]) -> list[list[list[tuple[bool, bytes]]]]:
        return [list(pool.map(one, frames(t))) for t in tensors]

    def unframe(frame: list[tuple[bool, bytes]]) -> bytes:
        zd = zstandard.ZstdDecompressor()
        planes = [data if raw else zd.decompress(data) for raw, data in frame]
        stacked = torch.frombuffer(bytearray(b"".join(planes)), dtype=torch.uint8).view(len(planes), -1)
        return stacked.t().contiguous().numpy().tobytes()

    def decompress(blobs: list[list[list[tuple[bool, bytes]]]], tensors: list[torch.Tensor]) -> list[bytes]:
        return [b"".join(pool.map(unframe, frame_blobs)) for frame_blobs in blobs]

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
        return [bytes(codec.decompress(b)) for b in blobs]

    return compress, decompress


def _size(blobs: Any) -> int:
    if isinstance(blobs, (bytes, bytearray)):
        return len(blobs)
    if isinstance(blobs, tuple):
        return len(blobs[1])
    return sum(map(_size, blobs))


def run_compression(hidden: int, steps: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Each codec on the trained state's weights and moments; ``{"status"}`` without the packages."""
    try:
        import zipnn
        import zstandard
    except ImportError as exc:
        return {"status": f"not measured: {exc.name} is not installed (bench-only: pip install zstandard zipnn)"}
    states = _trained_state(hidden, steps)
    out: dict[str, Any] = {"hidden": hidden, "steps": steps, "frame_bytes": FRAME_BYTES, "threads": os.cpu_count(),
                           "rows": []}
    with cf.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for what, tensors_by_name in states.items():
            tensors = list(tensors_by_name.values())
            raw = sum(t.numel() * t.element_size() for t in tensors)
            expected = [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
            dtype_name = "bfloat16" if tensors[0].dtype == torch.bfloat16 else "float32"
            codecs = {"byte-planes+zstd": _byte_planes_codec(zstandard, pool), "zstd (torch DCP)": _torch_zstd_codec(),
                      "zipnn": _zipnn_codec(zipnn, dtype_name)}
            for name, (compress, decompress) in codecs.items():
                c_times, d_times = [], []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    blobs = compress(tensors)
                    c_times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    back = decompress(blobs, tensors)
                    d_times.append(time.perf_counter() - t0)
                exact = back == expected
                row = {"data": what, "codec": name, "raw_bytes": raw, "compressed_bytes": _size(blobs),
                       "share": _size(blobs) / raw, "compress_mb_s": raw / 1e6 / statistics.median(c_times),
                       "decompress_mb_s": raw / 1e6 / statistics.median(d_times), "bit_exact": exact}
                out["rows"].append(row)
                log(f"compression {what}, {name}: {100 * row['share']:.1f} % of {raw} B, compress "
                    f"{row['compress_mb_s']:.0f} MB/s, decompress {row['decompress_mb_s']:.0f} MB/s, bit-exact {exact}")
    return out
