"""Staging: one device → host copy of every tensor piece into reusable shared memory.

Every tensor leaf becomes :class:`TensorShards`; each non-empty piece gets a slot in a
*slab* — a large shared-memory byte buffer (pinned where the pieces live on an
accelerator) — keyed by ``(fqn, offsets, sizes, dtype)``.  The writer process maps the
slabs once and reads the pieces in place, so the bytes are copied exactly once.  The next
save with the same pieces copies into the same slots (no allocation, no page faults);
pieces never seen before get a new slab, and slabs no piece of the current save uses are
released.  A few large slabs instead of one buffer per tensor keep the number of shared
file descriptors (and mmaps) small.

The description handed to the writer process (:class:`StagedStateDict`) holds only slab
ids and byte offsets; :func:`materialize` turns it back into ``{fqn: TensorShards}`` over
the mapped slabs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import TensorShards, is_tensor_leaf, to_tensor_shards

from .copier import DataCopier

__all__ = ["BufferKey", "StagedStateDict", "StagingArena", "StagingStats", "materialize"]

logger = logging.getLogger(__name__)

#: Slot alignment in bytes: a cache line, and a multiple of every dtype's item size.
ALIGN = 64

# (fqn, global offsets, sizes, dtype): a piece that can reuse the slot of an earlier save
BufferKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
# (global offsets, sizes, slab id or -1 for an empty piece, byte offset in the slab)
PieceRef = tuple[tuple[int, ...], tuple[int, ...], int, int]


@dataclass
class StagedStateDict:
    """What the writer process needs to rebuild the staged state dict (no tensor data).

    ``leaves`` keeps the flat order of the caller's state dict; each entry is
    ``("tensor", (global_shape, dtype, ragged, [PieceRef, ...]))`` or ``("object", copy)``.
    """

    leaves: dict[str, tuple[str, Any]] = field(default_factory=dict)
    slab_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class StagingStats:
    """What one staging did: bytes copied, of which in reused slots, and bytes newly allocated."""

    staged_bytes: int
    reused_bytes: int
    allocated_bytes: int
    pinned: bool


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pin(buffer: torch.Tensor, device_type: str) -> bool:
    """Page-lock a shared buffer for ``device_type`` DMA; False where that is not possible."""
    if device_type == "cuda":
        try:
            rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
            return int(rc) == 0
        except Exception as exc:  # noqa: BLE001 - unpinned still works, only slower
            logger.warning("async_save: cannot pin a %d-byte staging buffer: %s", buffer.numel(), exc)
    return False


def _unpin(buffer: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # noqa: BLE001
        pass


class _Slab:
    """One shared-memory byte buffer holding many staging slots."""

    def __init__(self, slab_id: int, nbytes: int, device_type: Optional[str]):
        self.slab_id = slab_id
        # _new_shared maps fresh shared memory directly (share_memory_() would copy into it).
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.pinned = _pin(self.buffer, device_type) if device_type else False

    def view(self, offset: int, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return slab_view(self.buffer, offset, sizes, dtype)

    def release(self) -> None:
        if self.pinned:
            _unpin(self.buffer)
            self.pinned = False


def slab_view(buffer: torch.Tensor, offset: int, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``sizes``-shaped ``dtype`` tensor at byte ``offset`` of a uint8 ``buffer`` (a view)."""
    nbytes = math.prod(sizes) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(sizes)


class StagingArena:
    """Reusable staging slots for the pieces of the state dicts one process saves.

    Not thread-safe: the async persister stages one save at a time, and only after the
    previous save has been written (the writer process reads the slots until then).
    """

    def __init__(self) -> None:
        self._slabs: dict[int, _Slab] = {}
        self._slots: dict[BufferKey, tuple[int, int]] = {}
        self._next_id = 0

    @property
    def slabs(self) -> dict[int, torch.Tensor]:
        """Live slab id → its shared uint8 buffer."""
        return {i: s.buffer for i, s in self._slabs.items()}

    def buffer_ptrs(self) -> dict[BufferKey, int]:
        """Slot of every known piece → its host address (tests: reuse means equal addresses)."""
        return {k: self._slabs[sid].buffer.data_ptr() + off for k, (sid, off) in self._slots.items()}

    def stage(self, state_dict: dict[str, Any]) -> tuple[StagedStateDict, StagingStats]:
        """Copy every tensor piece of ``state_dict`` into its staging slot; copy the rest.

        Returns the description for the writer process and what was done.  After it
        returns, the staged data no longer depends on ``state_dict`` (which is not
        modified).  Raises what :func:`to_tensor_shards` raises (e.g. for a ``Partial``
        DTensor) and whatever a registered :class:`DataCopier` handler raises.
        """
        flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
        shards: dict[str, TensorShards] = {}
        wanted: list[tuple[BufferKey, int, torch.Tensor]] = []
        device_type: Optional[str] = None
        for fqn, leaf in flat.items():
            if not is_tensor_leaf(leaf):
                continue
            ts = to_tensor_shards(leaf, fqn)
            shards[fqn] = ts
            for box, view in ts.pieces:
                if box.is_empty():
                    continue
                if view.device.type != "cpu":
                    device_type = view.device.type
                wanted.append(((fqn, box.offsets, box.sizes, ts.dtype), box.volume * ts.dtype.itemsize, view))

        reused = sum(n for key, n, _ in wanted if key in self._slots)
        missing = [(key, n) for key, n, _ in wanted if key not in self._slots]
        allocated = 0
        if missing:
            allocated = sum(_align(n) for _, n in missing)
            slab = _Slab(self._next_id, allocated, device_type)
            self._next_id += 1
            self._slabs[slab.slab_id] = slab
            offset = 0
            for key, n in missing:
                self._slots[key] = (slab.slab_id, offset)
                offset += _align(n)
        self._release_unused({key for key, _, _ in wanted})

        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for key, _, view in wanted:
            slab_id, offset = self._slots[key]
            dsts.append(self._slabs[slab_id].view(offset, key[2], key[3]))
            srcs.append(view)
        self._copy(dsts, srcs, device_type)

        staged = StagedStateDict(slab_ids=frozenset(self._slabs))
        for fqn, leaf in flat.items():
            leaf_shards = shards.get(fqn)
            if leaf_shards is None:
                staged.leaves[fqn] = ("object", DataCopier.copy(leaf))
                continue
            refs: list[PieceRef] = []
            for box, _ in leaf_shards.pieces:
                if box.is_empty():
                    refs.append((box.offsets, box.sizes, -1, 0))
                else:
                    slab_id, offset = self._slots[(fqn, box.offsets, box.sizes, leaf_shards.dtype)]
                    refs.append((box.offsets, box.sizes, slab_id, offset))
            staged.leaves[fqn] = ("tensor", (tuple(leaf_shards.global_shape), leaf_shards.dtype, leaf_shards.ragged, refs))
        stats = StagingStats(sum(n for _, n, _ in wanted), reused, allocated,
                             any(s.pinned for s in self._slabs.values()))
        return staged, stats

    def _release_unused(self, used: set[BufferKey]) -> None:
        live = {self._slots[k][0] for k in used}
        for slab_id in [i for i in self._slabs if i not in live]:
            self._slabs.pop(slab_id).release()
        self._slots = {k: v for k, v in self._slots.items() if v[0] in self._slabs}

    @staticmethod
    def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device_type: Optional[str]) -> None:
        if not dsts:
            return
        if device_type is None:
            # one C++ loop instead of a Python call per piece (optimizer states have thousands)
            torch._foreach_copy_(dsts, srcs)
            return
        for dst, src in zip(dsts, srcs):
            # into page-locked memory the device copy engine works asynchronously
            dst.copy_(src, non_blocking=src.device.type != "cpu")
        devices = {src.device for src in srcs if src.device.type != "cpu"}
        for device in devices:
            torch.accelerator.synchronize(device)

    def clear(self) -> None:
        """Release every slab (the next save allocates again)."""
        for slab in self._slabs.values():
            slab.release()
        self._slabs.clear()
        self._slots.clear()


def materialize(staged: StagedStateDict, slabs: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Rebuild the flat staged state dict: ``{fqn: TensorShards over slab views}`` + objects.

    Raises ``KeyError`` naming the FQN when a referenced slab is missing from ``slabs``.
    """
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
