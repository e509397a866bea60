"""Read a stored chunk's slice straight into its destination tensor with ``preadv``.

Measured on the 2-core dev machine, 2000 × 0.5 MiB bf16 tensors from the page cache:
``preadv`` into the destination 0.11 s, ``safe_open`` mmap view + ``copy_`` 0.4–2.9 s
(every 4 KiB page faults in, and the copy competes for the cores).  So the reader hands
the kernel the destination memory whenever the slice is contiguous in the file (a
row-prefix slice: what row sharding and ragged ranges produce) and the destination is a
contiguous CPU tensor; otherwise it reads the byte span once into a host buffer (pinned
for an accelerator destination) and copies from a strided view of it.
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import torch

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CorruptCheckpointError

__all__ = ["copy_into", "read_slice_into"]

_MAX_CHUNK = 1 << 30  # bytes per preadv call (Linux caps one call near 2 GiB)


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _buffer(tensor: torch.Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done : done + _MAX_CHUNK]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: needed {total} bytes at offset {offset}, the file ends after {done}"
            )
        done += n


def read_slice_into(
    fd: int,
    path: str,
    data_offset: int,
    chunk_sizes: Sequence[int],
    dtype: torch.dtype,
    offsets: Sequence[int],
    lengths: Sequence[int],
    dest: torch.Tensor,
) -> int:
    """Fill ``dest`` (shape ``lengths``) from the slice ``offsets+lengths`` of a stored chunk.

    ``data_offset`` is the file offset of the chunk's first byte.  Returns the bytes of the
    file the read spans (``core.chunks.slice_span`` × item size: what ``hp-dcp explain``
    predicts).  Raises :class:`CorruptCheckpointError` on a short file.
    """
    itemsize = dtype.itemsize
    first, span, contiguous = slice_span(chunk_sizes, offsets, lengths)
    if span == 0:
        return 0
    start = data_offset + first * itemsize
    if contiguous and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
        _pread_exact(fd, _buffer(dest), start, path)
        return span * itemsize
    # An accelerator destination is filled by an H2D copy, fastest from pinned memory.
    pin = dest.device.type not in ("cpu", "meta") and _accelerator_available()
    staging = torch.empty(span, dtype=dtype, pin_memory=pin)
    _pread_exact(fd, _buffer(staging), start, path)
    if contiguous:
        source = staging.view(tuple(lengths))
    else:
        strides = row_major_strides(chunk_sizes)
        source = staging.as_strided(tuple(lengths), tuple(strides))
    copy_into(dest, source)
    return span * itemsize


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``, casting when the dtypes differ; a same-dtype copy goes bit
    for bit through an integer view (``copy_`` has no kernel for ``bits16``, ``float4``,
    sub-byte ints, ... and the view keeps NaN payloads)."""
    view = _BITS.get(dest.dtype.itemsize) if dest.dtype == source.dtype and dest.dtype not in _BITS.values() else None
    if view is not None and dest.device.type != "meta":
        dest.view(view).copy_(source.view(view))
    else:
        dest.copy_(source)
