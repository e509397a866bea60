"""Staging memory and what the writer receives of it: slabs (large shared-memory byte buffers
holding many staging slots, the writer maps each once by its file descriptor), the copies into
them, and the staged state dict (slab offsets, no tensor data).  Exports :data:`ALIGN`,
:func:`align`, :func:`slab_view`, :class:`Slab`, :func:`copy_into_slots`, :func:`wait_for_copies`,
:func:`populate_slab`, :data:`PieceRef`, :class:`StagedStateDict`, :func:`materialize`."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import ChunkBox, TensorShards
from hyper_parallel_dcp.storage_fs.posix import populate_read

from ._torch_compat import cuda_host_register, cuda_host_unregister, foreach_copy, new_shared_storage

__all__ = ["ALIGN", "PieceRef", "Slab", "StagedStateDict", "align", "copy_into_slots", "materialize", "populate_slab",
           "slab_view", "wait_for_copies"]

logger = logging.getLogger(__name__)

#: Slot alignment in bytes: a cache line, and a multiple of every dtype's item size.
ALIGN = 64


def align(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def slab_view(buffer: torch.Tensor, offset: int, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``sizes``-shaped ``dtype`` tensor at byte ``offset`` of a uint8 ``buffer`` (a view)."""
    nbytes = math.prod(sizes) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(sizes)


class Slab:
    """One shared uint8 ``buffer`` of ``nbytes`` bytes, page-locked for pieces on CUDA."""

    def __init__(self, slab_id: int, nbytes: int, device_type: Optional[str]):
        self.slab_id = slab_id
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(max(nbytes, 1)))
        self.pinned = False
        if device_type == "cuda":
            try:
                cuda_host_register(self.buffer)
                self.pinned = True
            except Exception as exc:  # noqa: BLE001 - unpinned still works, only slower
                logger.warning("async_save: cannot pin a %d-byte staging buffer: %s", self.buffer.numel(), exc)

    def view(self, offset: int, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return slab_view(self.buffer, offset, sizes, dtype)

    def release(self) -> None:
        """Unpin; the memory goes once neither process references it."""
        if self.pinned:
            self.pinned = False
            with contextlib.suppress(Exception):  # the buffer goes anyway
                cuda_host_unregister(self.buffer)


def copy_into_slots(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device_type: Optional[str]) -> None:
    """Copy every source into its slot; returns once the copies are done (device sources:
    all queued on the current stream at once, then a wait for that stream only)."""
    if not dsts:
        return
    with torch.no_grad():
        foreach_copy(dsts, srcs, non_blocking=device_type is not None)
    if device_type is not None:
        wait_for_copies({src.device for src in srcs if not src.is_cpu})


def wait_for_copies(devices: set[torch.device]) -> None:
    """Wait for the copies queued on the current stream of each of ``devices``."""
    for device in devices:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        event.synchronize()


def populate_slab(buffer: torch.Tensor) -> bool:
    """Map every whole page of ``buffer`` into this process in one ``MADV_POPULATE_READ``
    (halves the writer's first write from a new slab); False where nothing was done."""
    start = buffer.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + buffer.numel()) // mmap.PAGESIZE * mmap.PAGESIZE
    return end > first and populate_read(first, end - first)


#: (global offsets, sizes, slab id or -1 for an empty piece, byte offset in the slab)
PieceRef = tuple[tuple[int, ...], tuple[int, ...], int, int]


@dataclass
class StagedStateDict:
    """What the writer process needs to rebuild a staged state dict: ``leaves`` in the flat
    order of the caller's state dict, each ``("tensor", (global_shape, dtype, ragged,
    [PieceRef, ...]))`` or ``("object", copy)``; ``slab_ids``, the slabs the pieces lie in."""

    leaves: dict[str, tuple[str, Any]] = field(default_factory=dict)
    slab_ids: frozenset[int] = frozenset()


def materialize(staged: StagedStateDict, slabs: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The flat staged state dict: ``{fqn: TensorShards over views of slabs}`` and objects;
    ``KeyError`` naming the FQN when a referenced slab is missing from ``slabs``."""
    out: dict[str, Any] = {}
    for fqn, (kind, value) in staged.leaves.items():
        if kind == "object":
            out[fqn] = value
            continue
        global_shape, dtype, ragged, refs = value
        pieces = []
        for offsets, sizes, slab_id, offset in refs:
            if slab_id < 0:
                view = torch.empty(sizes, dtype=dtype)
            else:
                buffer = slabs.get(slab_id)
                if buffer is None:
                    raise KeyError(f"{fqn!r}: staging slab {slab_id} was not received by the writer process")
                view = slab_view(buffer, offset, sizes, dtype)
            pieces.append((ChunkBox(offsets, sizes), view))
        out[fqn] = TensorShards(global_shape, dtype, pieces, ragged=ragged)
    return out
