"""The streaming safetensors writer: :func:`write_safetensors` writes chunks in the order
given straight from tensor memory, hashed as they pass (the importer's format names are
re-exported)."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import BinaryIO, Callable, NamedTuple, Optional, Sequence, Union

import torch
import xxhash

from hyper_parallel_dcp.core.errors import UnsupportedTensorError
from hyper_parallel_dcp.core.layout import tensor_problem

from .host_memory import LARGE_FOLIO, SMALL_FOLIO, PinnedBuffer, large_folio_writes
from .posix import IOV_MAX_BUFFERS, tensor_bytes
from .safetensors_header import SAFETENSORS_DTYPES, SafetensorsHeaderError, read_header

__all__ = ["SAFETENSORS_DTYPES", "EncodedHeader", "LateDigests", "SafetensorsHeaderError", "TensorEntry",
           "encode_header", "read_header", "tensor_bytes", "write_safetensors"]

BOUNCE_MIN_BYTES = 1 << 20  # a device chunk of at least this size is written through the pinned buffer


class TensorEntry:
    """One tensor to write: its key, ``fetch`` producing it when due, ``label`` naming it in
    errors; ``stable``: its bytes stay until :func:`write_safetensors` returns."""

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
    """A header as written: ``raw`` (length field, padded JSON), ``begins`` (data-section offsets)."""

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


class LateDigests:
    """Chunks :func:`write_safetensors` wrote unhashed (``stable`` entries' own bytes); a
    save calls :meth:`fill` once its fsync has started, so the hashing overlaps the disk."""

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


def write_safetensors(f: BinaryIO, entries: Sequence[TensorEntry], header: Optional[EncodedHeader] = None, *,
                      late: Optional[LateDigests] = None) -> list[tuple[int, int, str]]:
    """Write ``entries`` in order; returns ``(file offset, length, xxh3 hex)`` each.
    ``header``: ``encode_header(entries)`` if made; with ``late``, a ``stable`` entry's digest
    is left empty and its bytes go to ``late``.  ``ValueError`` naming a mismatched entry."""
    if header is None:
        header = encode_header(entries)
    f.write(header.raw)
    data_start = len(header.raw)
    writes = _AlignedWrites(f, data_start, LARGE_FOLIO if large_folio_writes() else SMALL_FOLIO)
    out: list[tuple[int, int, str]] = []
    bounce = PinnedBuffer()
    for entry, begin in zip(entries, header.begins):
        tensor = entry.fetch()
        copied = False  # a fresh host tensor, ours alone
        if not tensor.is_cpu:
            if tensor.is_meta:  # planned from its shape, but no planner supplied its data
                raise UnsupportedTensorError(f"{entry.label} {tensor_problem(tensor)}")
            if (tensor.is_contiguous() and tensor.numel() * tensor.element_size() >= BOUNCE_MIN_BYTES
                    and tensor.shape == entry.shape and tensor.dtype == entry.dtype):
                out.append((data_start + begin, entry.nbytes, _write_through(tensor, bounce, writes)))
                continue
            tensor = tensor.to("cpu")
            copied = True
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            copied = True
        if tensor.shape != entry.shape or tensor.dtype != entry.dtype:  # torch.Size equals a tuple
            raise ValueError(
                f"{entry.label}: data has shape {tuple(tensor.shape)} {tensor.dtype}, planned {entry.shape} {entry.dtype}")
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


def _write_through(tensor: torch.Tensor, bounce: PinnedBuffer, writes: _AlignedWrites) -> str:
    """Write the contiguous device ``tensor`` through ``bounce`` a part at a time; its xxh3."""
    flat = tensor.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    buffer = bounce.get(nbytes)
    whole = tensor_bytes(buffer)
    digest = xxhash.xxh3_64()
    for at in range(0, nbytes, buffer.numel()):
        length = min(buffer.numel(), nbytes - at)
        buffer[:length].copy_(flat[at:at + length])  # blocking: done when it returns
        digest.update(whole[:length])
        writes.add_now(whole[:length])
    return digest.hexdigest()


_NOTHING = torch.empty(0)  # what a written-through view keeps alive


class _AlignedWrites:
    """Chunk bytes written in ``writev`` batches ending on ``align`` boundaries (one folio
    per call); ``add`` holds a chunk that stays valid, ``add_now`` writes at once."""

    def __init__(self, f: BinaryIO, position: int, align: int = SMALL_FOLIO) -> None:
        self._f = f
        self._align = align
        try:
            self._fd: Optional[int] = f.fileno()
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
        """Queue ``view`` (bytes of ``tensor``, kept until written); ``owned``: a copy made for this write."""
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
        elif len(self._views) >= IOV_MAX_BUFFERS:
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
        _writev_all(self._fd, head, nbytes)  # the tensors are still referenced by _keep
        del views[:whole]
        del self._keep[:whole]
        del self._owned[:whole]
        self._position += nbytes
        self._pending -= nbytes
        if views and self._owned[0] and self._keep[0].nbytes > 4 * self._align:
            # the tail of a large copy, copied (< align) so that the copy is not held
            views[0] = memoryview(bytes(views[0]))
            self._keep[0] = _NOTHING
            self._owned[0] = False


def _writev_all(fd: Optional[int], views: list[memoryview], nbytes: int) -> None:
    assert fd is not None
    done = os.writev(fd, views)
    while done < nbytes:  # a short write (a signal; a full disk reports on the retry)
        for i, view in enumerate(views):
            if done < len(view):
                views = [view[done:]] + views[i + 1:]
                break
            done -= len(view)
        nbytes = sum(map(len, views))
        done = os.writev(fd, views)
