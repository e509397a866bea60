"""Streaming writer of standard safetensors files, hashing each tensor as it is written.

The ``safetensors`` library serialises a whole dict at once and orders tensors by dtype
first; a checkpoint needs chunks laid out in the global ``(fqn, offset)`` order (so a
load reads each file sequentially), written straight from tensor memory without building
the file in RAM, and a checksum computed on the bytes as they pass.  The file format is
the standard one (8-byte little-endian header length, JSON header padded to 8 bytes,
then the data), so ``safetensors.safe_open`` reads these files as is.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import BinaryIO, Sequence

import torch
import xxhash

__all__ = ["SAFETENSORS_DTYPES", "TensorEntry", "tensor_bytes", "write_safetensors"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class TensorEntry:
    """One tensor to write: its key, and a callable producing the CPU tensor when due."""

    __slots__ = ("key", "dtype", "shape", "nbytes", "fetch", "label")

    def __init__(self, key: str, dtype: torch.dtype, shape: Sequence[int], fetch, label: str = ""):
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{label or key}: dtype {dtype} cannot be stored in safetensors")
        self.key = key
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        n = 1
        for d in self.shape:
            n *= d
        self.nbytes = n * dtype.itemsize
        self.fetch = fetch
        self.label = label or key


def _header(entries: Sequence[TensorEntry]) -> tuple[bytes, list[int]]:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begins = []
    pos = 0
    for e in entries:
        header[e.key] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        begins.append(pos)
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, begins


def write_safetensors(f: BinaryIO, entries: Sequence[TensorEntry]) -> list[tuple[int, int, str]]:
    """Write ``entries`` in the given order; returns ``(file offset, length, xxh3 hex)`` each.

    ``fetch()`` of each entry is called just before it is written, so a device tensor is
    copied to host one chunk at a time.
    """
    header, begins = _header(entries)
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    data_start = 8 + len(header)
    out = []
    for entry, begin in zip(entries, begins):
        tensor = entry.fetch()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(
                f"{entry.label}: data has shape {tuple(tensor.shape)} {tensor.dtype}, planned {entry.shape} {entry.dtype}"
            )
        view = tensor_bytes(tensor)
        digest = xxhash.xxh3_64_hexdigest(view)
        f.write(view)
        out.append((data_start + begin, entry.nbytes, digest))
        del view, tensor
    return out


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
