"""The safetensors format as this project stores it: dtypes (:func:`stored_layout`),
headers (:func:`read_header`, the only parser) and :func:`header_digest`."""

from __future__ import annotations

import json
import math
import struct
from typing import BinaryIO, NamedTuple, Optional, Sequence, TypeGuard

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "HeaderEntry", "SafetensorsHeaderError", "entry_mismatch",
           "header_digest", "header_layout", "parse_header", "read_header", "read_header_bytes",
           "stored_layout", "to_stored"]

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
_KNOWN = frozenset(SAFETENSORS_DTYPES.values()) | {"F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C128"}
_ITEMSIZE = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}
_UINT_OF_SIZE = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}

#: Largest header accepted: the ``safetensors`` library's own limit, so that every file
#: this parser accepts the library opens too (and a corrupt length allocates nothing huge).
MAX_HEADER_BYTES = 100_000_000


def stored_layout(dtype: torch.dtype, shape: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The safetensors dtype and shape a chunk of ``dtype`` and ``shape`` is stored as:
    itself where the format names it, ``complex128`` as ``float64`` with a trailing dim of
    2, any other as the unsigned integer of its size.  ``TypeError`` for quantized dtypes."""
    if dtype in SAFETENSORS_DTYPES:  # every common dtype: once per chunk of a save, kept cheap
        return dtype, shape if type(shape) is tuple else tuple(int(d) for d in shape)
    shape = tuple(int(d) for d in shape)
    if dtype in _QUANTIZED:
        raise TypeError(f"quantized dtype {dtype} cannot be checkpointed (its scale and zero point are not "
                        "tensor data); dequantize it first")
    if dtype == torch.complex128:
        return torch.float64, shape + (2,)
    view = _UINT_OF_SIZE.get(dtype.itemsize)
    if view is None:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors")
    return view, shape


def to_stored(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the view :func:`stored_layout` names (the same bytes)."""
    if tensor.dtype in SAFETENSORS_DTYPES:
        return tensor
    dtype, _ = stored_layout(tensor.dtype, tensor.shape)
    if tensor.dtype == torch.complex128:
        return torch.view_as_real(tensor)
    return tensor.view(dtype)


def header_layout(dtype: torch.dtype, sizes: tuple[int, ...]) -> Optional[tuple[str, tuple[int, ...],
                                                                               tuple[int, ...]]]:
    """``(safetensors dtype, shape, row-major strides)`` of a chunk as its header records
    it; ``None`` where it cannot be stored (:func:`entry_mismatch` says why)."""
    try:
        stored_dtype, shape = stored_layout(dtype, sizes)
    except TypeError:
        return None
    name = SAFETENSORS_DTYPES.get(stored_dtype)
    return None if name is None else (name, shape, tuple(row_major_strides(sizes)))


def header_digest(raw: bytes, file_size: int) -> str:
    """xxh3-64 hex digest of a header's bytes (length field and JSON) and the file's size (8 bytes LE)."""
    digest = xxhash.xxh3_64(raw)
    digest.update(struct.pack("<Q", file_size))
    return digest.hexdigest()


class SafetensorsHeaderError(ValueError):
    """The header of a safetensors file is malformed (the message says how)."""


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header, with absolute file offsets of its data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header_bytes(f: BinaryIO, file_size: int) -> bytes:
    """The header bytes (length field and JSON) of the safetensors file ``f``;
    :class:`SafetensorsHeaderError` where the length field does not fit the file."""
    f.seek(0)
    raw_len = f.read(8)
    if len(raw_len) != 8:
        raise SafetensorsHeaderError(f"file has {file_size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", raw_len)
    if length > min(MAX_HEADER_BYTES, max(0, file_size - 8)):
        raise SafetensorsHeaderError(f"header length field {length} does not fit a file of {file_size} bytes")
    raw = f.read(length)
    if len(raw) != length:
        raise SafetensorsHeaderError(f"header truncated ({len(raw)} of {length} bytes)")
    return raw_len + raw


def read_header(f: BinaryIO, file_size: int) -> dict[str, HeaderEntry]:
    """Parse and check the header of the safetensors file ``f`` (``file_size`` bytes): its
    entries with absolute file offsets.  Raises :class:`SafetensorsHeaderError` saying
    what is wrong unless dtypes, shapes and data ranges agree and tile the data section."""
    return parse_header(read_header_bytes(f, file_size), file_size)


def parse_header(header: bytes, file_size: int) -> dict[str, HeaderEntry]:
    """:func:`read_header` of header bytes already read (:func:`read_header_bytes`)."""
    try:
        doc = json.loads(header[8:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise SafetensorsHeaderError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SafetensorsHeaderError("header is not a JSON object")
    data_start = len(header)
    out: dict[str, HeaderEntry] = {}
    for key, entry in doc.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsHeaderError(f"header entry {key!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _KNOWN:
            raise SafetensorsHeaderError(f"header entry {key!r} has an unknown dtype {dtype!r}")
        if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
            raise SafetensorsHeaderError(f"header entry {key!r} has a malformed shape or data_offsets")
        begin, end = offsets
        if begin > end or data_start + end > file_size:
            raise SafetensorsHeaderError(
                f"header entry {key!r}: data range [{begin}, {end}) lies outside the {file_size - data_start} data bytes")
        if dtype in _ITEMSIZE and end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise SafetensorsHeaderError(
                f"header entry {key!r}: {dtype} {list(shape)} needs {math.prod(shape) * _ITEMSIZE[dtype]} bytes, "
                f"its data range [{begin}, {end}) holds {end - begin}")
        out[key] = HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    # the data ranges tile the data section, as the safetensors library requires
    pos = data_start
    for key, entry in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != pos:
            raise SafetensorsHeaderError(
                f"header entry {key!r} starts at data byte {entry.begin - data_start}, expected "
                f"{pos - data_start} (data ranges overlap or leave a gap)")
        pos = entry.end
    if pos != file_size:
        raise SafetensorsHeaderError(
            f"the tensors' data ends at data byte {pos - data_start} but the file has {file_size - data_start} "
            "data bytes (trailing bytes)")
    return out


def entry_mismatch(entry: Optional[HeaderEntry], key: str, dtype: torch.dtype, shape: Sequence[int],
                   offset: int, length: int) -> Optional[str]:
    """Why header ``entry`` (for ``key``) is not the chunk the metadata describes; ``None`` if it is."""
    if entry is None:
        return f"key {key!r} is missing from the file's header"
    try:
        stored_dtype, shape = stored_layout(dtype, shape)
    except TypeError as exc:
        return str(exc)
    expected = SAFETENSORS_DTYPES.get(stored_dtype)
    if entry.dtype != expected:
        return f"key {key!r} is stored as {entry.dtype}, the metadata says {expected}"
    if entry.shape != tuple(shape):
        return f"key {key!r} has shape {list(entry.shape)}, the metadata says {list(shape)}"
    if entry.begin != offset or entry.end - entry.begin != length:
        return f"key {key!r} occupies bytes [{entry.begin}, {entry.end}), the metadata says [{offset}, {offset + length})"
    return None


def _int_list(value: object) -> TypeGuard[list[int]]:
    # type() and min() in C: twice per entry of every header a load parses
    return type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0))
