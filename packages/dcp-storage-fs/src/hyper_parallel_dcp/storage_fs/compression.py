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

import os
import struct
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CheckpointError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo, chunk_locator
from hyper_parallel_dcp.core.planner import ReadItem

from .incremental import missing_file_error

__all__ = ["CODEC_SUFFIX", "FRAME_BYTES", "ZSTD_EXTRA", "decode_span", "encode_chunk", "is_compressed_file",
           "CompressedFiles", "read_compressed_into", "zstd_module"]

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


def read_compressed_into(fd: int, info: StorageInfo, sizes: tuple[int, ...], dtype: torch.dtype, item: ReadItem,
                         dest: torch.Tensor, file: str, *, verify: bool) -> int:
    """Copy ``item``'s slice of the compressed chunk ``info`` (of shape ``sizes``) from the open
    file ``fd`` (named ``file``) into ``dest``; returns the payload bytes read.  ``verify``:
    first compare the whole payload's xxh3 with ``info.checksum``.  Raises
    :class:`CorruptCheckpointError` naming file and chunk, :class:`CheckpointError` naming the
    extra without ``zstandard``."""
    index = item.storage_index
    label = f"{file}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
    zstd = zstd_module(f"{file}: {index.fqn!r}, stored in the compressed file {info.relative_path},")

    def read_at(position: int, length: int) -> bytes:
        return os.pread(fd, max(0, min(length, info.length - position)), info.offset + position)

    read = 0
    if verify:
        read = info.length
        if xxhash.xxh3_64_hexdigest(read_at(0, info.length)) != info.checksum:
            raise CorruptCheckpointError(f"checksum mismatch in {label}: the compressed chunk does not match its "
                                         f"recorded xxh3 {info.checksum}")
    lengths = tuple(item.lengths) if item.lengths else sizes
    offsets = tuple(item.storage_offsets) if item.lengths else (0,) * len(sizes)
    first, span, _ = slice_span(sizes, offsets, lengths)
    width = dtype.itemsize
    raw, spanned = decode_span(read_at, first * width, (first + span) * width, width, zstd, lambda: label)
    if span:
        source = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
        dest.copy_(source.as_strided(lengths, row_major_strides(sizes), 0))
    return read + spanned


class CompressedFiles:
    """The open ``.zstd`` files of a checkpoint, for the reader."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}
        self._seen: tuple[Any, bool] = (None, False)  # (a metadata's files, whether one is compressed)

    def any_in(self, metadata: Any) -> bool:
        """Whether ``metadata`` (a ``Metadata`` or ``None``) names a compressed file (kept per file table)."""
        files = None if metadata is None else metadata.files
        if files is not self._seen[0]:
            self._seen = (files, files is not None and any(map(is_compressed_file, files)))
        return self._seen[1]

    def read_item(self, root: Path, metadata: Metadata, item: ReadItem, dest: torch.Tensor, offset: Optional[int],
                  strides: Any, verified: Optional[set[MetadataIndex]]) -> Optional[int]:
        """Read ``item`` of the checkpoint in directory ``root`` into ``dest`` (``dest.as_strided(item.lengths, strides, offset)`` with an
        ``offset``) when its chunk is in a compressed file: the payload bytes read; ``None``,
        nothing done, otherwise.  ``verified``: check each chunk's payload checksum once (the
        chunks checked are added).  Raises :class:`CheckpointNotFoundError` naming a missing
        file (and, for a reference, who needs it), and what :func:`read_compressed_into` raises."""
        index = item.storage_index
        locate = chunk_locator(metadata)
        where = None if locate is None else locate(index)
        if where is None or not is_compressed_file(where[0]):
            return None
        name = where[0]
        path = root / name
        handle = self._open.get(name)
        if handle is None:
            try:
                handle = self._open[name] = open(path, "rb")
            except FileNotFoundError:
                raise missing_file_error(str(path), name) from None
        verify = verified is not None and index not in verified
        md = metadata.state_dict_metadata[index.fqn]
        target = dest if offset is None else dest.as_strided(item.lengths, strides, offset)
        read = read_compressed_into(handle.fileno(), metadata.storage_data[index], tuple(where[2]),  # type: ignore
                                    md.properties.dtype, item, target, str(path), verify=verify)  # type: ignore
        if verify:
            verified.add(index)  # type: ignore[union-attr]
        return read

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()
