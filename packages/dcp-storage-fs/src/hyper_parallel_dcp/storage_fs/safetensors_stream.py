"""The safetensors format: a streaming writer that hashes as it writes, and the one header parser.

The ``safetensors`` library serialises a whole dict at once and orders tensors by dtype
first; a checkpoint needs chunks laid out in the global ``(fqn, offset)`` order (so a
load reads each file sequentially), written straight from tensor memory without building
the file in RAM, and a checksum computed on the bytes as they pass.  The file format is
the standard one (8-byte little-endian header length, JSON header padded to 8 bytes,
then the data), so ``safetensors.safe_open`` reads these files as is.

``read_header`` is the only safetensors header parser of the project: the
filesystem reader, the offline verifier and the Hugging Face importer all use it, so
they accept and refuse the same files.

``header_digest`` is the xxh3 of a file's header bytes (length field and JSON) as
:func:`encode_header` makes them, and of the file's size: the writer records it in
``.metadata``, and a reader that reads the same bytes back (:func:`read_header_bytes`)
from a file of that size knows the header is the one written with those storage
entries without parsing it.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from typing import BinaryIO, Callable, NamedTuple, Sequence, TypeGuard, Union

import torch
import xxhash

from .host_memory import large_folio_writes

__all__ = [
    "SAFETENSORS_DTYPES",
    "EncodedHeader",
    "HeaderEntry",
    "LateDigests",
    "SafetensorsHeaderError",
    "TensorEntry",
    "encode_header",
    "entry_mismatch",
    "from_stored",
    "header_digest",
    "parse_header",
    "read_header",
    "read_header_bytes",
    "stored_layout",
    "tensor_bytes",
    "to_stored",
    "write_safetensors",
]

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


_UINT_OF_SIZE = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def stored_layout(dtype: torch.dtype, shape: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The safetensors dtype and shape a chunk of ``dtype`` and ``shape`` is stored as.

    A dtype the safetensors format names is stored as itself.  Any other (``float8_e8m0fnu``,
    ``float8_e4m3fnuz``, ``float4_e2m1fn_x2``, ``bits16``, ``complex32``, sub-byte ints, ...)
    is stored as the unsigned integer of the same size, same shape, bytes unchanged;
    ``complex128`` (16 bytes, no such integer) as ``float64`` with a trailing dim of 2.
    The true dtype is in ``.metadata``.  Raises ``TypeError`` for quantized dtypes (their
    scale and zero point are not in the bytes).
    """
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
    if dtype == tensor.dtype:
        return tensor
    if tensor.dtype == torch.complex128:
        return torch.view_as_real(tensor)
    return tensor.view(dtype)


def from_stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`to_stored`: a stored view read back as ``dtype``."""
    if tensor.dtype == dtype:
        return tensor
    if dtype == torch.complex128:
        return torch.view_as_complex(tensor.contiguous())
    return tensor.view(dtype)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class TensorEntry:
    """One tensor to write: its key, and a callable producing the CPU tensor when due.

    ``label`` names the tensor in errors: a string, or a callable that builds it (a save
    makes one entry per chunk, and the name is only needed when something is wrong).
    ``stable``: the tensor ``fetch()`` returns keeps its bytes until
    :func:`write_safetensors` returns, so the writer may hold it and send it with the
    next ones; a ``fetch`` that refills one buffer for each call must leave it False.
    """

    __slots__ = ("key", "dtype", "shape", "nbytes", "fetch", "_label", "stable")

    def __init__(self, key: str, dtype: torch.dtype, shape: Sequence[int], fetch: Callable[..., torch.Tensor],
                 label: Union[str, Callable[[], str]] = "", stable: bool = False):
        if dtype not in SAFETENSORS_DTYPES:
            text = label() if callable(label) else label
            raise TypeError(f"{text or key}: dtype {dtype} cannot be stored in safetensors")
        self.key = key
        self.dtype = dtype
        self.shape = shape if type(shape) is tuple else tuple(int(d) for d in shape)
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self.fetch = fetch
        self._label = label
        self.stable = stable

    @property
    def label(self) -> str:
        label = self._label() if callable(self._label) else self._label
        return label or self.key


class EncodedHeader(NamedTuple):
    """A safetensors header as written: ``raw`` is the 8-byte length field and the padded
    JSON, ``begins`` each entry's data offset relative to the data section."""

    raw: bytes
    begins: list[int]


def encode_header(entries: Sequence[TensorEntry]) -> EncodedHeader:
    """The header :func:`write_safetensors` writes for ``entries`` (in their order)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begins = []
    pos = 0
    for e in entries:
        header[e.key] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        begins.append(pos)
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return EncodedHeader(struct.pack("<Q", len(raw)) + raw, begins)


def header_digest(raw: bytes, file_size: int) -> str:
    """xxh3-64 hex digest of a header's bytes (:attr:`EncodedHeader.raw`,
    :func:`read_header_bytes`) followed by the file's size (8 bytes, little-endian):
    equal digests mean the same header in a file of the size it was written with, so its
    data ranges still lie inside the file (235 kB for 2000 tensors hash in microseconds)."""
    digest = xxhash.xxh3_64(raw)
    digest.update(struct.pack("<Q", file_size))
    return digest.hexdigest()


class LateDigests:
    """Chunks :func:`write_safetensors` wrote without hashing them first; :meth:`fill`
    hashes them afterwards.

    A save hashes them once its files are written and their fsync has started: the 13 ms
    that xxh3 takes over a rank's 125 MiB then overlap the disk instead of delaying every
    write (2-core dev machine, 2 ranks saving 2000 chunks, 125 MiB each: 260 → 240 ms).  Only a
    ``stable`` entry's own bytes wait here (the caller keeps them unchanged until the save
    returns); a chunk copied on the way (from a device, made contiguous) is hashed at once,
    so that no copy outlives its write.
    """

    def __init__(self) -> None:
        self._views: list[tuple[int, memoryview]] = []

    def add(self, position: int, view: memoryview) -> None:
        self._views.append((position, view))

    def fill(self, placed: list[tuple[int, int, str]]) -> None:
        """Put the digest of each waiting chunk into its ``placed`` entry."""
        for position, view in self._views:
            offset, length, _ = placed[position]
            placed[position] = (offset, length, xxhash.xxh3_64_hexdigest(view))
        self._views.clear()


def write_safetensors(f: BinaryIO, entries: Sequence[TensorEntry], header: EncodedHeader | None = None, *,
                      late: LateDigests | None = None) -> list[tuple[int, int, str]]:
    """Write ``entries`` in the given order; returns ``(file offset, length, xxh3 hex)`` each.

    ``header`` is ``encode_header(entries)`` when the caller made it already (to record
    its digest).  ``fetch()`` of each entry is called just before it is written, so a
    device tensor is copied to host one chunk at a time.  A chunk may wait to go out with
    the next ones in a write that ends on a 2 MiB boundary of the file (256 KiB on a VM
    with free page reporting; see ``_AlignedWrites``), but only when it stays valid
    until then: the entry is ``stable``, or the tensor is a copy made here (from a
    device, or made contiguous).  Any other chunk is written before the next ``fetch()``.
    With ``late``, the digest of a ``stable`` entry written from its own bytes is left
    empty and the bytes go to ``late``, whose ``fill`` hashes them later.
    """
    if header is None:
        header = encode_header(entries)
    f.write(header.raw)
    begins = header.begins
    data_start = len(header.raw)
    writes = _AlignedWrites(f, data_start, _LARGE_FOLIO if large_folio_writes() else _WRITE_ALIGN)
    out: list[tuple[int, int, str]] = []
    bounce = _Bounce()
    for entry, begin in zip(entries, begins):
        tensor = entry.fetch()
        copied = False  # a fresh host tensor, ours alone
        if not tensor.is_cpu:
            if tensor.is_meta:  # planned from its shape, but no planner supplied its data
                from hyper_parallel_dcp.core.errors import UnsupportedTensorError
                from hyper_parallel_dcp.core.layout import tensor_problem

                raise UnsupportedTensorError(f"{entry.label} {tensor_problem(tensor)}")
            if (tensor.is_contiguous() and tensor.numel() * tensor.element_size() >= _BOUNCE_MIN
                    and tensor.shape == entry.shape and tensor.dtype == entry.dtype):
                out.append((data_start + begin, entry.nbytes, bounce.write(tensor, writes)))
                continue
            tensor = tensor.to("cpu")
            copied = True
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            copied = True
        if tensor.shape != entry.shape or tensor.dtype != entry.dtype:  # torch.Size equals a tuple
            raise ValueError(
                f"{entry.label}: data has shape {tuple(tensor.shape)} {tensor.dtype}, planned {entry.shape} {entry.dtype}"
            )
        view = tensor_bytes(tensor)
        if late is not None and entry.stable and not copied:
            late.add(len(out), view)
            digest = ""
        else:
            digest = xxhash.xxh3_64_hexdigest(view)
        if entry.stable or copied:
            writes.add(view, tensor, copied)
        else:
            writes.add_now(view)
        out.append((data_start + begin, entry.nbytes, digest))
        del view, tensor
    writes.finish()
    return out


#: file data goes out in writes that end on multiples of this (see ``_AlignedWrites``) ...
_LARGE_FOLIO = 2 << 20
#: ... or of this where 2 MiB folios are costly (``host_memory.large_folio_writes``)
_WRITE_ALIGN = 256 << 10

_NOTHING = torch.empty(0)  # what a written-through view keeps alive

# a device chunk of at least this many bytes goes to the file through a _Bounce
_BOUNCE_MIN = 1 << 20


class _Bounce:
    """A reused host buffer (page-locked where an accelerator is) through which device
    chunks go to the file, a part at a time.

    ``tensor.to("cpu")`` of every chunk allocates fresh host memory whose pages fault in
    on first touch: measured on an H200 host (a VM), a fresh host copy of 1 GiB of device
    tensors took 0.93 s where a copy into a pinned buffer took 0.02 s, and a save of
    those tensors 2.30 s against 0.95 s for a raw write + fsync of the bytes.  Each part
    is copied (blocking), hashed into the chunk's digest and written before the next
    part reuses the buffer.
    """

    CAPACITY = 64 << 20

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def _host(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < min(nbytes, self.CAPACITY):
            size = min(max(nbytes, self._buffer.numel() if self._buffer is not None else 0), self.CAPACITY)
            try:
                self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no accelerator to pin for: pageable, still reused
                self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer

    def write(self, tensor: torch.Tensor, writes: _AlignedWrites) -> str:
        """Write the bytes of the contiguous ``tensor`` through the buffer; its xxh3 hex digest."""
        flat = tensor.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        buffer = self._host(nbytes)
        whole = tensor_bytes(buffer)
        digest = xxhash.xxh3_64()
        for at in range(0, nbytes, buffer.numel()):
            length = min(buffer.numel(), nbytes - at)
            buffer[:length].copy_(flat[at : at + length])  # blocking: done when it returns
            view = whole[:length]
            digest.update(view)
            writes.add_now(view)
        return digest.hexdigest()


class _AlignedWrites:
    """Chunk bytes written in batches whose ends fall on ``align`` boundaries of the file.

    The kernel sizes the page cache's folios by the writes that fill them: a range of
    ``align`` bytes written by one call becomes one folio of that size, which a reader's
    mapping maps with one call (a 2 MiB folio: with one page-table entry).  Written chunk
    by chunk (64 KiB each, or several MiB starting anywhere, as the header shifts every
    chunk) most such ranges are cut by a chunk boundary and stay in small folios.

    Measured on the 2-core dev machine, 2 ranks, 2000 × 128 KiB tensors (a 64 KiB chunk
    each), two runs each way: populating the mappings of a Shard(0) → Shard(1) load 9.0
    and 9.9 ms chunk by chunk, 5.5 with 64 KiB, 3.4 and 3.4 with 256 KiB, the load
    146-150 → 139-142 ms; the saves faster too (one ``writev`` per 4 chunks: 218-232 →
    179-202 ms).  The 246 MiB dense state dict (chunks of MiBs) loaded and saved the
    same.  With 2 MiB (one 125 MiB file): populating 2.4 → 0.05 ms, unmapping 1.0 → 0.02
    ms, a strided copy of half of every row of 64 MiB from the mapping 22 → 17 ms (the
    TLB), ``preadv`` of 64 MiB 11 → 8-10 ms.

    The chunks of one batch go out in one ``writev``; the batch keeps its tensors alive
    until written.  Only a chunk whose bytes stay valid that long is held (``add``); any
    other goes out at once, with what is pending (``add_now``).  ``f`` without a file
    descriptor (an in-memory buffer, an upload stream) gets plain ``write`` calls.

    2 MiB except on a VM with free page reporting (``host_memory``), where a 2 MiB folio
    takes a free 2 MiB block that the host has often reclaimed and faults back in on first
    touch.  Measured there, two processes each writing a 125 MiB file: the first aligned
    writes of a process took 290-320 ms of CPU instead of 52 (plain: 60), and the default
    benchmark's first saves went from 0.17 to 0.40 s (dense) while the steady state was
    12 % faster than plain writes.  256 KiB folios showed no such cost (first saves of a
    process: small 244, 231 ms against 274, 429 chunk by chunk; dense 205, 249 against
    229, 251; on 12-04, 256 MiB on 2 ranks: 168-242 ms against 395-436 with 2 MiB), as
    long as the guest has unreported free memory: a 1 GiB save on 2 ranks
    made 8 s after freeing the previous one's page cache took ~1.8 s with either size (0.53
    s once the memory was in use).  ``HP_DCP_ALIGNED_WRITES`` forces either size.
    """

    _MAX_BUFFERS = 512  # below IOV_MAX (1024 on Linux)

    def __init__(self, f: BinaryIO, position: int, align: int = _WRITE_ALIGN) -> None:
        self._f = f
        self._align = align
        try:
            self._fd: int | None = f.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
            self._fd = None
        else:
            f.flush()  # the header first, from f's buffer
        self._position = position  # file offset of the first pending byte
        self._views: list[memoryview] = []
        self._keep: list[torch.Tensor] = []
        self._owned: list[bool] = []  # per view: its tensor is a copy made for the write
        self._pending = 0

    def add(self, view: memoryview, tensor: torch.Tensor, owned: bool = False) -> None:
        """Queue ``view`` (bytes of ``tensor``, kept alive until written); ``owned``: the
        tensor is a copy made for this write (held only until its last full boundary)."""
        if self._fd is None:
            self._f.write(view)
            return
        if not len(view):
            return
        self._views.append(view)
        self._keep.append(tensor)
        self._owned.append(owned)
        self._pending += len(view)
        end = self._position + self._pending
        if end - end % self._align > self._position:
            self._write(end - end % self._align - self._position)
        elif len(self._views) >= self._MAX_BUFFERS:
            self._write(self._pending)

    def add_now(self, view: memoryview) -> None:
        """Write ``view`` now, after what is pending (its tensor may change after this)."""
        if self._fd is None:
            self._f.write(view)
            return
        if len(view):
            self._views.append(view)
            self._keep.append(_NOTHING)
            self._owned.append(False)
            self._pending += len(view)
        if self._pending:
            self._write(self._pending)

    def finish(self) -> None:
        """Write what is pending; ``f``'s position is then the end of the data."""
        if self._fd is None:
            return
        if self._pending:
            self._write(self._pending)
        self._f.seek(self._position)  # f's own idea of its position, after writes around it

    def _write(self, nbytes: int) -> None:
        """Write the first ``nbytes`` pending bytes; the rest stays pending."""
        head: list[memoryview] = []
        taken = whole = 0
        views = self._views
        while taken < nbytes:
            view = views[whole]
            if taken + len(view) > nbytes:  # the boundary cuts this view: its tail waits
                head.append(view[:nbytes - taken])
                views[whole] = view[nbytes - taken:]
                break
            head.append(view)
            taken += len(view)
            whole += 1
        self._write_all(head, nbytes)  # the tensors are still referenced by _keep
        del views[:whole]
        del self._keep[:whole]
        del self._owned[:whole]
        self._position += nbytes
        self._pending -= nbytes
        if views and self._owned[0] and self._keep[0].nbytes > 4 * self._align:
            # the tail of a large copy: copied again (< align), so that the copy itself
            # is not held while the next chunks are staged
            views[0] = memoryview(bytes(views[0]))
            self._keep[0] = _NOTHING
            self._owned[0] = False

    def _write_all(self, views: list[memoryview], nbytes: int) -> None:
        assert self._fd is not None
        done = os.writev(self._fd, views)
        while done < nbytes:  # a short write (a signal, a full disk reports on the retry)
            for i, view in enumerate(views):
                if done < len(view):
                    views = [view[done:]] + views[i + 1:]
                    break
                done -= len(view)
            nbytes = sum(map(len, views))
            done = os.writev(self._fd, views)


#: Largest header accepted: the ``safetensors`` library's own limit (100 MB), so that every
#: file this parser accepts the library opens too; a corrupted length field must not make
#: us allocate gigabytes either.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsHeaderError(ValueError):
    """The header of a safetensors file is malformed (the message says how)."""


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header, with absolute file offsets of its data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header_bytes(f: BinaryIO, file_size: int) -> bytes:
    """The header bytes (8-byte length field and JSON) of the safetensors file open as
    ``f`` (``file_size`` bytes); raises :class:`SafetensorsHeaderError` where the length
    field does not fit the file."""
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
    """Parse and check the header of the safetensors file open as ``f`` (``file_size`` bytes).

    Reads only the header.  Checks that the length field, JSON, dtypes, shapes and data
    ranges are consistent and lie inside the file; raises :class:`SafetensorsHeaderError`
    saying what is wrong otherwise.  Offsets in the result are absolute file offsets.
    """
    return parse_header(read_header_bytes(f, file_size), file_size)


def parse_header(header: bytes, file_size: int) -> dict[str, HeaderEntry]:
    """:func:`read_header` of header bytes already read (:func:`read_header_bytes`)."""
    length = len(header) - 8
    try:
        doc = json.loads(header[8:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise SafetensorsHeaderError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SafetensorsHeaderError("header is not a JSON object")
    data_start = 8 + length
    known = set(SAFETENSORS_DTYPES.values()) | {"F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C128"}
    itemsize = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}
    out: dict[str, HeaderEntry] = {}
    for key, entry in doc.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsHeaderError(f"header entry {key!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in known:
            raise SafetensorsHeaderError(f"header entry {key!r} has an unknown dtype {dtype!r}")
        if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
            raise SafetensorsHeaderError(f"header entry {key!r} has a malformed shape or data_offsets")
        begin, end = offsets
        if begin > end or data_start + end > file_size:
            raise SafetensorsHeaderError(
                f"header entry {key!r}: data range [{begin}, {end}) lies outside the {file_size - data_start} data bytes"
            )
        if dtype in itemsize and end - begin != math.prod(shape) * itemsize[dtype]:
            raise SafetensorsHeaderError(
                f"header entry {key!r}: {dtype} {list(shape)} needs {math.prod(shape) * itemsize[dtype]} bytes, "
                f"its data range [{begin}, {end}) holds {end - begin}"
            )
        out[key] = HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    _check_tiling(out, data_start, file_size)
    return out


def _check_tiling(entries: dict[str, HeaderEntry], data_start: int, file_size: int) -> None:
    """The data ranges must cover the data section exactly, without gaps or overlaps (the
    ``safetensors`` library refuses a file otherwise)."""
    pos = data_start
    for key, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != pos:
            raise SafetensorsHeaderError(
                f"header entry {key!r} starts at data byte {entry.begin - data_start}, expected "
                f"{pos - data_start} (data ranges overlap or leave a gap)"
            )
        pos = entry.end
    if pos != file_size:
        raise SafetensorsHeaderError(
            f"the tensors' data ends at data byte {pos - data_start} but the file has {file_size - data_start} "
            "data bytes (trailing bytes)"
        )


def entry_mismatch(entry: HeaderEntry | None, key: str, dtype: torch.dtype, shape: Sequence[int],
                   offset: int, length: int) -> str | None:
    """Why header ``entry`` (for ``key``) is not the chunk the metadata describes; None if it is."""
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
        return (f"key {key!r} occupies bytes [{entry.begin}, {entry.end}), the metadata says "
                f"[{offset}, {offset + length})")
    return None


def _int_list(value: object) -> TypeGuard[list[int]]:
    # type() and min() in C: this runs twice per entry of every header a load opens
    # (the generator it replaces was a fifth of parsing a 2000-entry header)
    return type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0))

