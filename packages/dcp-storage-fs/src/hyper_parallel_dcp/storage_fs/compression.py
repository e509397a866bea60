"""Lossless compression of tensor chunks (SPEC §14): byte planes, zstd in frames.

``save(..., compression="zstd")`` writes each rank's tensor chunks into ``_rank{r}_.zstd``
(the file name in ``.metadata`` names the codec) instead of ``_rank{r}_.safetensors``: one
payload per chunk, whose raw bytes are cut into frames of :data:`FRAME_BYTES` (a multiple
of the element width); each frame's bytes are split into byte planes by element width
(the exponent bytes of floats together compress, the low mantissa bytes do not dilute
them) and zstd-compressed, with zstd's content checksum per frame.  A payload is ``<u32 frame bytes><u32 frame count>``, the
frames' compressed sizes (u64 each), then the frames; its checksum is the xxh3 of the
payload as stored.  A load decompresses only the frames the slice it reads touches
(:func:`decode_span`).  Needs the ``zstandard`` package, the ``[zstd]`` extra.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import torch

from hyper_parallel_dcp.core.errors import CheckpointError, CorruptCheckpointError

__all__ = ["CODEC_SUFFIX", "FRAME_BYTES", "ZSTD_EXTRA", "decode_span", "encode_chunk", "is_compressed_file",
           "zstd_module"]

#: the suffix of a rank's file of compressed chunks: ``_rank{r}_.zstd``
CODEC_SUFFIX = ".zstd"
#: raw bytes per frame (rounded down to the element width): what a partial load decompresses at least
FRAME_BYTES = 4 << 20
#: what to install for compressed checkpoints
ZSTD_EXTRA = "hyper-parallel-dcp-storage-fs[zstd]"
_HEAD = struct.Struct("<II")


def is_compressed_file(name: str) -> bool:
    """Whether data file ``name`` holds compressed chunks."""
    return name.endswith(CODEC_SUFFIX)


def zstd_module(what: str) -> Any:
    """The ``zstandard`` module; :class:`CheckpointError` naming the extra (and ``what``
    needed it) when it is not installed."""
    try:
        import zstandard
    except ImportError:
        raise CheckpointError(f"{what} needs zstd compression, which is not installed: "
                              f"pip install '{ZSTD_EXTRA}' (the zstandard package)") from None
    return zstandard


def _frame_bytes(width: int) -> int:
    return FRAME_BYTES - FRAME_BYTES % width


def encode_chunk(raw: torch.Tensor, width: int, zstd: Any, level: int = 3) -> bytes:
    """The payload of one chunk: ``raw`` (its bytes, a flat uint8 CPU tensor) of ``width``-byte elements."""
    step = _frame_bytes(width)
    # each frame carries zstd's content checksum: a damaged frame fails its decompression
    compressor = zstd.ZstdCompressor(level=level, write_checksum=True)
    frames = []
    for at in range(0, raw.numel(), step):
        part = raw[at:at + step]
        planes = part.view(-1, width).t().contiguous() if width > 1 else part
        frames.append(compressor.compress(planes.numpy()))
    head = _HEAD.pack(step, len(frames)) + struct.pack(f"<{len(frames)}Q", *map(len, frames))
    return b"".join([head, *frames])


def decode_span(read_at: Callable[[int, int], bytes], start: int, end: int, width: int, zstd: Any,
                where: Callable[[], str]) -> tuple[bytes, int]:
    """``(raw bytes [start, end) of the chunk, payload bytes read)``; ``read_at(offset, n)``
    reads the payload.  Raises :class:`CorruptCheckpointError` naming ``where()`` (the file
    and chunk) and the frame for a frame that does not decompress to its size."""
    head = read_at(0, _HEAD.size)
    if len(head) < _HEAD.size:
        raise CorruptCheckpointError(f"{where()}: compressed chunk truncated (no frame table)")
    step, count = _HEAD.unpack(head)
    sizes = struct.unpack(f"<{count}Q", read_at(_HEAD.size, 8 * count)) if count else ()
    if end <= start:
        return b"", _HEAD.size + 8 * count
    first, last = start // step, (end - 1) // step
    if step == 0 or step % width or last >= count:
        raise CorruptCheckpointError(f"{where()}: the frame table ({count} frames of {step} bytes) does not cover "
                                     f"bytes [{start}, {end})")
    position = _HEAD.size + 8 * count + sum(sizes[:first])
    blob = read_at(position, sum(sizes[first:last + 1]))
    decompressor = zstd.ZstdDecompressor()
    out, at = [], 0
    for frame in range(first, last + 1):
        data = blob[at:at + sizes[frame]]
        at += sizes[frame]
        try:
            planes = decompressor.decompress(data)
        except zstd.ZstdError as exc:
            raise CorruptCheckpointError(f"{where()}: compressed frame {frame} of {count} is corrupt ({exc}); the "
                                         "checkpoint is damaged: restore it or load another") from None
        if len(planes) % width or (frame < count - 1 and len(planes) != step):
            raise CorruptCheckpointError(f"{where()}: compressed frame {frame} of {count} decompressed to "
                                         f"{len(planes)} bytes, not {step}")
        raw = torch.frombuffer(bytearray(planes), dtype=torch.uint8)
        out.append((raw.view(width, -1).t().contiguous() if width > 1 else raw).view(-1))
    joined = torch.cat(out) if len(out) > 1 else out[0]
    base = first * step
    return joined[start - base:end - base].numpy().tobytes(), len(blob) + _HEAD.size + 8 * count
