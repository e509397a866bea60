"""Staging: one device → host copy of every tensor piece into reusable slots of shared-memory
slabs (large byte buffers, each mapped once by the writer by its file descriptor), keyed by
``(fqn, offsets, sizes, dtype)``; a save with the last one's layout checks each leaf and
copies, with none of a first staging's per-piece work (:class:`RepeatedLayout`, on a device
:class:`DevicePack`).  The writer receives a :class:`StagedStateDict` (slab offsets, no
tensor data) and rebuilds it with :func:`materialize`.  Exports :class:`StagingArena`,
:class:`StagingStats`, :data:`BufferKey`, :class:`Slab`, :func:`slab_view`, :data:`ALIGN`,
:func:`align`, :func:`copy_into_slots`, :func:`wait_for_copies`, :func:`populate_slab`,
:data:`PieceRef`, :class:`StagedStateDict`, :func:`materialize`, :data:`LeafCheck`,
:func:`leaf_check`, :class:`RepeatedLayout`, :class:`DevicePack`."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import ChunkBox, RaggedShard, TensorShards
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf, to_tensor_shards
from hyper_parallel_dcp.storage_fs.posix import malloc_trim, populate_read

from ._torch_compat import (
    cuda_host_register,
    cuda_host_unregister,
    dtensor_class,
    dtensor_local,
    dtensor_spec,
    foreach_copy,
    new_shared_storage,
)
from .copier import DataCopier

__all__ = ["ALIGN", "BufferKey", "DevicePack", "LeafCheck", "PieceRef", "RepeatedLayout", "Slab", "StagedStateDict",
           "StagingArena", "StagingStats", "align", "copy_into_slots", "leaf_check", "materialize", "populate_slab",
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


#: A tensor leaf's reuse check, ``(token, whole)``: a DTensor's spec or a plain tensor's
#: (shape, dtype, device), and whether its one non-empty piece is its whole local tensor;
#: ``None``: not reusable (a ragged geometry may change between steps).
LeafCheck = Optional[tuple[Any, bool]]


def leaf_check(leaf: Any, shards: TensorShards, dtensor_cls: Any) -> LeafCheck:
    """The :data:`LeafCheck` of a tensor leaf and its shards."""
    if isinstance(leaf, (RaggedShard, TensorShards)):
        return None
    if dtensor_cls is not None and isinstance(leaf, dtensor_cls):
        nonempty = [view for box, view in shards.pieces if not box.is_empty()]
        return dtensor_spec(leaf), len(nonempty) == 1 and nonempty[0] is dtensor_local(leaf)
    return (leaf.shape, leaf.dtype, leaf.device), leaf.numel() > 0


@dataclass
class RepeatedLayout:
    """What a save of the same layout reuses (no reference to the caller's tensors):
    ``dsts`` are the slots of the non-empty pieces, in staging order."""

    keys: tuple[str, ...]
    checks: list[LeafCheck]  # per flat leaf, None for an object leaf
    dsts: list[torch.Tensor]
    tensor_leaves: dict[str, tuple[str, Any]]
    object_fqns: tuple[str, ...]
    staged_bytes: int
    pack: Optional[DevicePack]  # made with the first save's copy when a piece is on a device, else None

    def sources(self, flat: dict[str, Any]) -> Optional[list[torch.Tensor]]:
        """The source of every slot, in ``dsts`` order, when ``flat`` has this layout; else ``None``."""
        if len(flat) != len(self.keys) or tuple(flat) != self.keys:
            return None
        dtensor_cls = dtensor_class()
        srcs: list[torch.Tensor] = []
        for (fqn, leaf), check in zip(flat.items(), self.checks):
            if check is None:
                if is_tensor_leaf(leaf):
                    return None
                continue
            token, whole = check
            if dtensor_cls is not None and isinstance(leaf, dtensor_cls):
                spec = dtensor_spec(leaf)
                if spec is not token and spec != token:
                    return None
            elif type(token) is tuple and isinstance(leaf, torch.Tensor):
                if leaf.shape != token[0] or leaf.dtype != token[1] or leaf.device != token[2]:
                    return None
            else:
                return None
            if whole:
                srcs.append(dtensor_local(leaf) if type(token) is not tuple else leaf)
            else:
                srcs.extend(view for box, view in to_tensor_shards(leaf, fqn).pieces if not box.is_empty())
        return srcs if len(srcs) == len(self.dsts) else None

    def copy(self, srcs: list[torch.Tensor]) -> None:
        """Copy ``srcs`` (from :meth:`sources`) into the slots; returns once they are done."""
        if self.pack is None:
            copy_into_slots(self.dsts, srcs, None)
            return
        with torch.no_grad():
            self.pack.copy(srcs)
        wait_for_copies(self.pack.devices)


#: Device pieces up to this size are gathered on the device before going to the host.
_PACK_PIECE_BYTES = 256 << 10
#: At most this much device memory per process holds gathered pieces.
_PACK_TOTAL_BYTES = 64 << 20


class DevicePack:
    """A repeated save's small device pieces, gathered into a device buffer mirroring their
    slots, then copied to the host in one copy per run of adjacent slots.  Large pieces,
    those past the budget and lone ones are copied one by one; ``host_sources=True``
    gathers host pieces too (for the tests)."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, host_sources: bool = False) -> None:
        small: list[tuple[int, int, int]] = []  # (slab address, byte offset in the slab, position)
        budget = _PACK_TOTAL_BYTES
        for position, (dst, src) in enumerate(zip(dsts, srcs)):
            if (src.is_cpu and not host_sources) or dst.nbytes > _PACK_PIECE_BYTES or align(dst.nbytes) > budget:
                continue
            budget -= align(dst.nbytes)
            small.append((dst.untyped_storage().data_ptr(), int(dst.storage_offset()) * dst.element_size(), position))
        small.sort()
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        self.runs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slab bytes, device scratch bytes)
        packed: set[int] = set()
        start = 0
        while start < len(small):
            ptr, first, position = small[start]
            device = srcs[position].device
            end, run_end = start, first
            while (end < len(small) and small[end][0] == ptr and small[end][1] == run_end
                   and srcs[small[end][2]].device == device):
                run_end = small[end][1] + align(dsts[small[end][2]].nbytes)
                end += 1
            if end - start > 1:
                host = torch.empty(0, dtype=torch.uint8).set_(dsts[position].untyped_storage())[first:run_end]
                scratch = torch.empty(run_end - first, dtype=torch.uint8, device=device)
                typed: dict[torch.dtype, torch.Tensor] = {}  # the run as each dtype (slots are 64-byte aligned)
                for _, offset, at in small[start:end]:
                    dst = dsts[at]
                    if dst.dtype not in typed:
                        typed[dst.dtype] = scratch.view(dst.dtype)
                    positions, views = groups.setdefault((device, dst.dtype), ([], []))
                    positions.append(at)
                    element = (offset - first) // dst.dtype.itemsize
                    views.append(typed[dst.dtype].as_strided(dst.shape, dst.stride(), element))
                    packed.add(at)
                self.runs.append((host, scratch))
            start = max(end, start + 1)
        self.groups = list(groups.values())
        self.rest = [i for i in range(len(dsts)) if i not in packed]
        self.rest_dsts = [dsts[i] for i in self.rest]
        self.packed = len(packed)
        self.devices = {src.device for src in srcs if not src.is_cpu}

    def copy(self, srcs: list[torch.Tensor]) -> None:
        """Queue every copy of ``srcs`` into its slot (non-blocking; the caller waits)."""
        for positions, views in self.groups:
            foreach_copy(views, [srcs[i] for i in positions])
        for host, scratch in self.runs:
            host.copy_(scratch, non_blocking=True)
        if self.rest:
            foreach_copy(self.rest_dsts, [srcs[i] for i in self.rest], non_blocking=True)


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
