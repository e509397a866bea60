"""The staging arena: one device → host copy of every tensor piece into reusable slots,
keyed by ``(fqn, offsets, sizes, dtype)``.  Exports :data:`BufferKey`,
:class:`StagingStats`, :class:`StagingArena`."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import TensorShards
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf, to_tensor_shards
from hyper_parallel_dcp.storage_fs.posix import malloc_trim

from ._torch_compat import dtensor_class, foreach_copy
from .copier import DataCopier
from .repeat import DevicePack, LeafCheck, RepeatedLayout, leaf_check
from .staged import PieceRef, Slab, StagedStateDict, align, copy_into_slots

__all__ = ["BufferKey", "StagingArena", "StagingStats"]

#: (fqn, global offsets, sizes, dtype): a piece that can reuse the slot of an earlier save
BufferKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
#: (slab id, byte offset, sizes, dtype): where one piece is staged
_Slot = tuple[int, int, tuple[int, ...], torch.dtype]

#: Bytes moved from private copies into a new slab before those copies are freed.
_FILL_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class StagingStats:
    """What one staging did: bytes copied, of which into reused slots, and bytes allocated."""

    staged_bytes: int
    reused_bytes: int
    allocated_bytes: int
    pinned: bool


@dataclass
class _PendingSlab:
    slab_id: int
    nbytes: int
    slots: list[_Slot]  # every piece's slot, in staging order
    private: dict[int, torch.Tensor]  # position in ``slots`` -> the private copy of that piece


class StagingArena:
    """Reusable staging slots for one process's saves, one at a time (:meth:`complete` may
    run on another thread)."""

    def __init__(self) -> None:
        self._slabs: dict[int, Slab] = {}
        self._slots: dict[BufferKey, tuple[int, int]] = {}
        self._next_id = 0
        self._layout: Optional[RepeatedLayout] = None
        self._pending: Optional[_PendingSlab] = None
        self._pending_lock = threading.Lock()

    @property
    def slabs(self) -> dict[int, torch.Tensor]:
        """Live slab id → its shared uint8 buffer (a pending slab is filled first)."""
        self.complete()
        return {i: s.buffer for i, s in self._slabs.items()}

    def buffer_ptrs(self) -> dict[BufferKey, int]:
        """Slot of every known piece → its host address (equal addresses: a slot reused)."""
        self.complete()
        return {k: self._slabs[sid].buffer.data_ptr() + off for k, (sid, off) in self._slots.items()}

    def stage(self, state_dict: dict[str, Any]) -> tuple[StagedStateDict, StagingStats]:
        """Copy every tensor piece of ``state_dict`` into its slot, every other leaf with
        :class:`DataCopier`; returns the writer's description and the stats.  Raises what
        :func:`to_tensor_shards` or a :class:`DataCopier` handler raises."""
        self.complete()
        flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
        layout = self._layout
        srcs = layout.sources(flat) if layout is not None else None
        if layout is None or srcs is None:
            return self._stage_new_layout(flat)
        layout.copy(srcs)
        leaves = dict(layout.tensor_leaves)
        for fqn in layout.object_fqns:
            leaves[fqn] = ("object", DataCopier.copy(flat[fqn]))
        if layout.object_fqns:
            leaves = {fqn: leaves[fqn] for fqn in layout.keys}
        staged = StagedStateDict(leaves, frozenset(self._slabs))
        return staged, StagingStats(layout.staged_bytes, layout.staged_bytes, 0, self._pinned())

    def _pinned(self) -> bool:
        return any(s.pinned for s in self._slabs.values())

    def _stage_new_layout(self, flat: dict[str, Any]) -> tuple[StagedStateDict, StagingStats]:
        dtensor_cls = dtensor_class()
        shards_of: dict[str, tuple[TensorShards, list[Optional[BufferKey]]]] = {}  # keys: None for an empty piece
        wanted: list[tuple[BufferKey, int, torch.Tensor]] = []  # (key, bytes, source) per non-empty piece
        checks: list[LeafCheck] = []
        device_type: Optional[str] = None
        reusable = True
        layouts: dict[Any, Any] = {}  # see to_tensor_shards
        for fqn, leaf in flat.items():
            if not is_tensor_leaf(leaf):
                checks.append(None)
                continue
            shards = to_tensor_shards(leaf, fqn, layouts=layouts)
            check = leaf_check(leaf, shards, dtensor_cls)
            checks.append(check)
            reusable = reusable and check is not None
            keys: list[Optional[BufferKey]] = []
            for box, view in shards.pieces:
                n = view.numel()  # cheaper than the box's volume, in a loop over thousands
                key = (fqn, box.offsets, box.sizes, shards.dtype) if n else None
                keys.append(key)
                if key is not None:
                    wanted.append((key, n * shards.dtype.itemsize, view))
                    device_type = device_type if view.is_cpu else view.device.type
            shards_of[fqn] = (shards, keys)

        defer = device_type is None
        reused, allocated, new_slab_id = self._assign_slots(wanted, device_type, defer)
        slot_list: list[_Slot] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        private: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for key, _, view in wanted:
                slab_id, offset = self._slots[key]
                if slab_id == new_slab_id and defer:
                    private[len(slot_list)] = view.clone()
                else:
                    dsts.append(self._slabs[slab_id].view(offset, key[2], key[3]))
                    srcs.append(view)
                slot_list.append((slab_id, offset, key[2], key[3]))
        copy_into_slots(dsts, srcs, device_type)
        if private:
            self._pending = _PendingSlab(new_slab_id, allocated, slot_list, private)

        leaves: dict[str, tuple[str, Any]] = {}
        tensor_leaves: dict[str, tuple[str, Any]] = {}
        for fqn, leaf in flat.items():
            if fqn not in shards_of:
                leaves[fqn] = ("object", DataCopier.copy(leaf))
                continue
            shards, keys = shards_of[fqn]
            refs: list[PieceRef] = [(box.offsets, box.sizes, *(self._slots[key] if key else (-1, 0)))
                                    for (box, _), key in zip(shards.pieces, keys)]
            leaves[fqn] = tensor_leaves[fqn] = ("tensor", (tuple(shards.global_shape), shards.dtype, shards.ragged,
                                                           refs))
        staged_bytes = sum(n for _, n, _ in wanted)
        staged = StagedStateDict(leaves, frozenset([*self._slabs, *([new_slab_id] if private else [])]))
        self._layout = None
        if reusable:
            object_fqns = tuple(fqn for fqn in flat if fqn not in shards_of)
            # a pending slab's views are made by complete(), once it exists
            self._layout = RepeatedLayout(tuple(flat), checks, [] if private else dsts, tensor_leaves, object_fqns,
                                          staged_bytes, DevicePack(dsts, srcs) if device_type is not None else None)
        return staged, StagingStats(staged_bytes, reused, allocated, self._pinned())

    def _assign_slots(self, wanted: list[tuple[BufferKey, int, torch.Tensor]], device_type: Optional[str],
                      defer: bool) -> tuple[int, int, int]:
        """Slot the new pieces in a new slab (allocated unless ``defer``), release unused slabs;
        returns the bytes reused, the bytes allocated and the new slab's id (-1: none)."""
        missing = [(key, n) for key, n, _ in wanted if key not in self._slots]
        reused = sum(n for _, n, _ in wanted) - sum(n for _, n in missing)
        allocated = sum(align(n) for _, n in missing)
        new_slab_id = -1
        if missing:
            new_slab_id, self._next_id = self._next_id, self._next_id + 1
            if not defer:
                self._slabs[new_slab_id] = Slab(new_slab_id, allocated, device_type)
            offset = 0
            for key, n in missing:
                self._slots[key] = (new_slab_id, offset)
                offset += align(n)
        live = {self._slots[key][0] for key, _, _ in wanted} | {new_slab_id}
        for slab_id in [i for i in self._slabs if i not in live]:
            self._slabs.pop(slab_id).release()
        self._slots = {k: v for k, v in self._slots.items() if v[0] in live}
        return reused, allocated, new_slab_id

    def complete(self) -> None:
        """Allocate the slab a staging left pending and move its pieces there, in batches of
        :data:`_FILL_BATCH_BYTES`, trimming the heap between them (docs/perf); called
        before the writer maps the slabs."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            self._slabs[pending.slab_id] = Slab(pending.slab_id, pending.nbytes, None)
            dsts = [self._slabs[sid].view(offset, sizes, dtype) for sid, offset, sizes, dtype in pending.slots]
            private = pending.private
            positions = list(private)
            batch: list[int] = []
            batch_bytes = 0
            for i, position in enumerate(positions):
                batch.append(position)
                batch_bytes += private[position].nbytes
                if batch_bytes >= _FILL_BATCH_BYTES or i == len(positions) - 1:
                    foreach_copy([dsts[p] for p in batch], [private.pop(p) for p in batch])
                    batch, batch_bytes = [], 0  # this batch's private copies are gone
                    malloc_trim()
            if self._layout is not None:
                self._layout.dsts = dsts

    def clear(self) -> None:
        """Release every slab (the next save allocates again)."""
        self._pending = None
        for slab in self._slabs.values():
            slab.release()
        self._slabs.clear()
        self._slots.clear()
        self._layout = None
