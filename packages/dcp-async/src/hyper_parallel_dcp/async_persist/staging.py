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

import ctypes
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import TensorShards, check_tensor, is_tensor_leaf, to_tensor_shards
from hyper_parallel_dcp.core.ragged import RaggedShard

from .copier import DataCopier

__all__ = ["BufferKey", "StagedStateDict", "StagingArena", "StagingStats", "materialize"]

logger = logging.getLogger(__name__)

#: Slot alignment in bytes: a cache line, and a multiple of every dtype's item size.
ALIGN = 64

# (fqn, global offsets, sizes, dtype): a piece that can reuse the slot of an earlier save
BufferKey = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
# (slab id, byte offset, sizes, dtype): where one piece is staged
_Slot = tuple[int, int, tuple[int, ...], torch.dtype]
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
    #: the arena's layout these leaves were staged with (``None``: not reusable); a later
    #: save of the same layout stages its tensors where this one did
    layout_id: Optional[int] = None
    #: ``leaves`` holds only the object leaves: the tensor leaves are those of the last
    #: description of ``layout_id`` (the writer keeps it; see :meth:`without_tensors`)
    tensors_held: bool = False

    def without_tensors(self) -> StagedStateDict:
        """This description with its object leaves only, for a writer holding the tensor
        leaves of ``layout_id`` already: 2000 tensors' leaves are ~110 KB to pickle and
        send (1.5-6 ms of a later save's blocking time on the 2-core AMD EPYC VM)."""
        if self.layout_id is None:
            raise ValueError("a description without a layout id has no tensor leaves to hold")
        objects = {fqn: leaf for fqn, leaf in self.leaves.items() if leaf[0] == "object"}
        return StagedStateDict(objects, self.slab_ids, self.layout_id, tensors_held=True)

    def with_tensors_of(self, held: Optional[StagedStateDict]) -> StagedStateDict:
        """The whole description again from one :meth:`without_tensors` made and the last
        whole description ``held``; itself when it is whole.  Raises ``RuntimeError``
        when ``held`` is not a whole description of the same layout."""
        if not self.tensors_held:
            return self
        if held is None or held.tensors_held or held.layout_id != self.layout_id:
            raise RuntimeError(f"async writer: a save refers to staged layout {self.layout_id}, which this writer "
                               f"does not hold ({None if held is None else held.layout_id})")
        leaves = dict(held.leaves)  # the flat order of the state dict; object leaves replaced in place
        leaves.update(self.leaves)
        return StagedStateDict(leaves, self.slab_ids, self.layout_id)


@dataclass(frozen=True)
class StagingStats:
    """What one staging did: bytes copied, of which in reused slots, and bytes newly allocated."""

    staged_bytes: int
    reused_bytes: int
    allocated_bytes: int
    pinned: bool


#: Bytes moved from private copies into a new slab before those copies are freed.
_FILL_BATCH_BYTES = 64 << 20


def _libc_malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc; absent from musl and other C libraries
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_size_t]
    return fn


_malloc_trim = _libc_malloc_trim()


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc ``malloc_trim``).

    A first save holds every piece twice for a moment: the private copies made while
    the caller waited, and the new slab they move into.  Freed, those copies stay in
    the heap, so the slab's pages and the page cache the writer fills come from memory
    the host has not touched yet; on this benchmark's VM a first touch costs ~5x a
    reused page (505 MiB written to page cache: 0.85 s CPU against 0.12 s).  Measured
    at 1 GiB dense, world 2: the writer's first write took 0.67 s CPU against 0.2 s for
    a later save; with this call, 0.2 s.  False where the C library has no such call.
    """
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


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


def _new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """Fresh shared memory of ``nbytes`` bytes, its pages allocated, as a storage that
    pickles to the writer process as its file descriptor (no copy).

    ``UntypedStorage._new_shared`` allocates the pages (``posix_fallocate``) inside a call
    that holds the GIL: 58 ms for 505 MiB on the dev machine.  The joining thread allocates
    the first save's slab while the training thread returns from ``async_save``, which
    then waited those 40-60 ms for the GIL (1 GiB dense, world 2: first-save blocking 232
    ms against a 180 ms clone of the same tensors).  A memfd allocated by
    ``os.posix_fallocate`` (which releases the GIL) and mapped by the call that maps a
    received descriptor is the same kind of storage.  Elsewhere (no memfd, or the
    ``file_system`` sharing strategy, whose storages pickle by name) ``_new_shared``.
    """
    import torch.multiprocessing as torch_mp

    memfd_create = getattr(os, "memfd_create", None)
    # what torch.multiprocessing calls to map a descriptor it received (private API)
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if memfd_create is None or from_fd is None or torch_mp.get_sharing_strategy() != "file_descriptor":
        return torch.UntypedStorage._new_shared(nbytes)
    fd = memfd_create("hp-dcp-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        # allocated now: memory running out fails here, not as SIGBUS in a later copy
        os.posix_fallocate(fd, 0, nbytes)
        return from_fd(fd, nbytes)  # maps a duplicate of fd
    finally:
        os.close(fd)


class _Slab:
    """One shared-memory byte buffer holding many staging slots."""

    def __init__(self, slab_id: int, nbytes: int, device_type: Optional[str]):
        self.slab_id = slab_id
        # fresh shared memory mapped directly (share_memory_() would copy into it)
        storage = _new_shared_storage(max(nbytes, 1))
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


#: Device pieces up to this size are gathered on the device before going to the host.
_PACK_PIECE_BYTES = 256 << 10
#: At most this much device memory per process holds gathered pieces.
_PACK_TOTAL_BYTES = 64 << 20


class _DevicePack:
    """The small device pieces of the saves of one layout, gathered on the device and
    sent to the host in one copy per run of adjacent slots.

    Every device -> host copy is its own transfer that costs microseconds to launch,
    whatever its size.  With the first save of a layout, its small pieces get a device
    scratch buffer that mirrors their slab slots byte for byte (views made once, here);
    each later save fills it with one fused device copy per dtype, and one copy moves
    each run of adjacent slots to the host.  Measured on an H200 host (32 x
    32 MiB + 33 x 1 MiB + 2000 x 4 KiB bf16, best of 5): 23.3 ms against 26.4 ms one by
    one; a plain device -> pinned copy of the same bytes takes 20.2 ms.  Device memory: at most
    :data:`_PACK_TOTAL_BYTES`; pieces over :data:`_PACK_PIECE_BYTES` or past that budget
    are copied one by one as before.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, host_sources: bool = False) -> None:
        """``host_sources=True`` gathers host pieces too (the tests drive it that way)."""
        # (slab address, byte offset in the slab, position) of each small device piece
        small: list[tuple[int, int, int]] = []
        budget = _PACK_TOTAL_BYTES
        for position, (dst, src) in enumerate(zip(dsts, srcs)):
            n = dst.nbytes
            if (src.is_cpu and not host_sources) or n > _PACK_PIECE_BYTES or _align(n) > budget:
                continue
            budget -= _align(n)
            small.append((dst.untyped_storage().data_ptr(), int(dst.storage_offset()) * dst.element_size(), position))
        small.sort()
        packed: set[int] = set()
        # per (device, dtype): the pieces' positions and their scratch views
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        self.runs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slab bytes, device scratch bytes)
        start = 0
        while start < len(small):
            ptr, first, position = small[start]
            device = srcs[position].device
            end, run_end = start, first
            # adjacent slots: the next starts where this one's aligned end is
            while (end < len(small) and small[end][0] == ptr and small[end][1] == run_end
                   and srcs[small[end][2]].device == device):
                run_end = small[end][1] + _align(dsts[small[end][2]].nbytes)
                end += 1
            if end - start > 1:
                slab_bytes = dsts[position].untyped_storage()
                host = torch.empty(0, dtype=torch.uint8).set_(slab_bytes)[first:run_end]
                scratch = torch.empty(run_end - first, dtype=torch.uint8, device=device)
                typed: dict[torch.dtype, torch.Tensor] = {}  # the run as each dtype (slots are 64-byte aligned)
                for _, offset, at in small[start:end]:
                    dst = dsts[at]
                    dtype = dst.dtype
                    as_dtype = typed.get(dtype)
                    if as_dtype is None:
                        as_dtype = typed[dtype] = scratch.view(dtype)
                    # one as_strided: a third of slab_view's slice and two views (2000 pieces)
                    view = as_dtype.as_strided(dst.shape, dst.stride(), (offset - first) // dtype.itemsize)
                    positions, views = groups.setdefault((device, dtype), ([], []))
                    positions.append(at)
                    views.append(view)
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
            torch._foreach_copy_(views, [srcs[i] for i in positions])
        for host, scratch in self.runs:
            host.copy_(scratch, non_blocking=True)
        if self.rest:
            torch._foreach_copy_(self.rest_dsts, [srcs[i] for i in self.rest], non_blocking=True)


@dataclass
class _Layout:
    """What a repeated save with the same flat keys and tensor geometry reuses.

    Measured with 2000 small tensors: the per-piece Python work of a first stage (DTensor
    geometry, slot keys, slab views, the writer's description) costs as much as the copy
    itself; a later save of the same layout only checks each leaf against ``checks``
    (~0.5 us: a DTensor's spec compares by value, its hash cached) and copies.  Holds no
    reference to the caller's tensors.
    """

    keys: tuple[str, ...]
    # per flat leaf, in order: None for an object leaf, else (DTensor spec | (shape, dtype,
    # device) of a plain tensor, whole_local): whole_local means the leaf's one piece is
    # its whole local tensor (the source needs no geometry at all)
    checks: list[Optional[tuple[Any, bool]]]
    dsts: list[torch.Tensor]
    tensor_leaves: dict[str, tuple[str, Any]]
    object_fqns: tuple[str, ...]
    device_type: Optional[str]
    staged_bytes: int
    layout_id: int  # unique in its arena
    pack: Optional[_DevicePack] = None


def _leaf_check(leaf: Any, ts: TensorShards, dtensor_cls: Any) -> Optional[tuple[Any, bool]]:
    """The cheap identity of a tensor leaf's staging geometry; ``None``: cannot be reused."""
    if isinstance(leaf, (RaggedShard, TensorShards)):
        return None  # a ragged geometry may change between steps
    if dtensor_cls is not None and isinstance(leaf, dtensor_cls):
        nonempty = [view for box, view in ts.pieces if not box.is_empty()]
        return leaf._spec, len(nonempty) == 1 and nonempty[0] is leaf._local_tensor
    return (leaf.shape, leaf.dtype, leaf.device), leaf.numel() > 0


class StagingArena:
    """Reusable staging slots for the pieces of the state dicts one process saves.

    Not thread-safe: the async persister stages one save at a time, and only after the
    previous save has been written (the writer process reads the slots until then).
    """

    def __init__(self) -> None:
        self._slabs: dict[int, _Slab] = {}
        self._slots: dict[BufferKey, tuple[int, int]] = {}
        self._next_id = 0
        self._layout: Optional[_Layout] = None
        self._layouts_made = 0
        self._whole_local: dict[Any, tuple[tuple[int, ...], ChunkBox, Any]] = {}  # see _shards
        # a slab allocated and filled after stage() returned, see stage(defer_new_slab=True):
        # (slab id, bytes, every piece's slot in copy order, {position: private host copy})
        self._pending: Optional[tuple[int, int, list[_Slot], dict[int, torch.Tensor]]] = None
        self._pending_lock = threading.Lock()  # complete() runs on the joining thread

    @property
    def slabs(self) -> dict[int, torch.Tensor]:
        """Live slab id → its shared uint8 buffer (a deferred slab is filled first)."""
        self.complete()
        return {i: s.buffer for i, s in self._slabs.items()}

    @property
    def has_pending(self) -> bool:
        """Whether a deferred stage left a slab for :meth:`complete` to fill."""
        return self._pending is not None

    def buffer_ptrs(self) -> dict[BufferKey, int]:
        """Slot of every known piece → its host address (tests: reuse means equal addresses)."""
        self.complete()
        return {k: self._slabs[sid].buffer.data_ptr() + off for k, (sid, off) in self._slots.items()}

    def stage(self, state_dict: dict[str, Any], *, defer_new_slab: bool = False) -> tuple[StagedStateDict, StagingStats]:
        """Copy every tensor piece of ``state_dict`` into its staging slot; copy the rest.

        Returns the description for the writer process and what was done.  After it
        returns, the staged data no longer depends on ``state_dict`` (which is not
        modified).  With ``defer_new_slab=True`` and only host pieces, pieces that need a
        new slab are copied into private memory instead and :meth:`complete` later
        allocates the slab and moves them there (the caller calls it off its critical
        path, before the writer maps the slabs).  Raises what :func:`to_tensor_shards`
        raises (e.g. for a ``Partial`` DTensor) and whatever a registered
        :class:`DataCopier` handler raises.
        """
        self.complete()
        flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
        layout = self._layout
        srcs = self._sources(layout, flat) if layout is not None else None
        if srcs is None:
            return self._stage_new_layout(flat, defer_new_slab)
        assert layout is not None
        if layout.device_type is None:
            self._copy(layout.dsts, srcs, None)
        else:
            if layout.pack is None:
                layout.pack = _DevicePack(layout.dsts, srcs)
            with torch.no_grad():
                layout.pack.copy(srcs)
            self._wait_for_copies(layout.pack.devices)
        leaves = dict(layout.tensor_leaves)
        for fqn in layout.object_fqns:
            leaves[fqn] = ("object", DataCopier.copy(flat[fqn]))
        staged = StagedStateDict(leaves={fqn: leaves[fqn] for fqn in layout.keys} if layout.object_fqns else leaves,
                                 slab_ids=frozenset(self._slabs), layout_id=layout.layout_id)
        return staged, StagingStats(layout.staged_bytes, layout.staged_bytes, 0,
                                    any(s.pinned for s in self._slabs.values()))

    @staticmethod
    def _sources(layout: _Layout, flat: dict[str, Any]) -> Optional[list[torch.Tensor]]:
        """The source of every piece, in ``layout.dsts`` order, when ``flat`` has the layout."""
        if len(flat) != len(layout.keys) or tuple(flat) != layout.keys:
            return None
        dtensor_module = sys.modules.get("torch.distributed.tensor")
        dtensor_cls = dtensor_module.DTensor if dtensor_module is not None else None
        srcs: list[torch.Tensor] = []
        for (fqn, leaf), check in zip(flat.items(), layout.checks):
            if check is None:
                if is_tensor_leaf(leaf):
                    return None
                continue
            token, whole = check
            if dtensor_cls is not None and isinstance(leaf, dtensor_cls):
                spec = leaf._spec
                if spec is not token and spec != token:  # the same DTensor: the same spec object
                    return None
                if whole:
                    srcs.append(leaf._local_tensor)
                    continue
            elif type(token) is tuple and isinstance(leaf, torch.Tensor):
                shape, dtype, device = token
                if leaf.shape != shape or leaf.dtype != dtype or leaf.device != device:
                    return None
                if whole:
                    srcs.append(leaf)
                continue
            else:
                return None
            srcs.extend(view for box, view in to_tensor_shards(leaf, fqn).pieces if not box.is_empty())
        return srcs if len(srcs) == len(layout.dsts) else None

    def _shards(self, leaf: Any, fqn: str, dtensor_cls: Any) -> tuple[TensorShards, Optional[tuple[Any, bool]]]:
        """:func:`to_tensor_shards` and the leaf's reuse check (see :func:`_leaf_check`).

        Remembers by spec the geometry of a DTensor whose one piece is its whole local
        tensor: a model repeats a few layouts thousands of times (2000 leaves: 8 ms of
        geometry -> 1 ms), and such a leaf's check is known without looking at its pieces.
        """
        if dtensor_cls is None or not isinstance(leaf, dtensor_cls):
            ts = to_tensor_shards(leaf, fqn)
            return ts, _leaf_check(leaf, ts, dtensor_cls)
        spec = leaf._spec
        known = self._whole_local.get(spec)
        if known is not None:
            check_tensor(leaf._local_tensor, fqn)
            # this leaf's own spec object: a later save finds it by identity (see _sources)
            return TensorShards(known[0], leaf.dtype, [(known[1], leaf._local_tensor)]), (spec, known[2][1])
        ts = to_tensor_shards(leaf, fqn)
        check = _leaf_check(leaf, ts, dtensor_cls)
        if len(ts.pieces) == 1 and ts.pieces[0][1] is leaf._local_tensor:
            self._whole_local[spec] = (ts.global_shape, ts.pieces[0][0], check)
        return ts, check

    def _stage_new_layout(self, flat: dict[str, Any], defer_new_slab: bool) -> tuple[StagedStateDict, StagingStats]:
        dtensor_module = sys.modules.get("torch.distributed.tensor")
        dtensor_cls = dtensor_module.DTensor if dtensor_module is not None else None
        # per flat leaf: (fqn, its TensorShards and each piece's slot key (None: empty piece)) or (fqn, None)
        leaves: list[tuple[str, Optional[tuple[TensorShards, list[Optional[BufferKey]]]]]] = []
        wanted: list[tuple[BufferKey, int, torch.Tensor]] = []
        checks: list[Optional[tuple[Any, bool]]] = []
        reusable = True
        device_type: Optional[str] = None
        # The per-piece work here is Python: numel() rather than the box's volume, no
        # second pass rebuilding keys (2000 pieces: the copy's own cost again, measured).
        for fqn, leaf in flat.items():
            if not is_tensor_leaf(leaf):
                checks.append(None)
                leaves.append((fqn, None))
                continue
            ts, check = self._shards(leaf, fqn, dtensor_cls)
            reusable = reusable and check is not None
            checks.append(check)
            dtype = ts.dtype
            itemsize = dtype.itemsize
            keys: list[Optional[BufferKey]] = []
            for box, view in ts.pieces:
                n = view.numel()
                if not n:
                    keys.append(None)
                    continue
                if not view.is_cpu:
                    device_type = view.device.type
                key = (fqn, box.offsets, box.sizes, dtype)
                keys.append(key)
                wanted.append((key, n * itemsize, view))
            leaves.append((fqn, (ts, keys)))

        slots = self._slots
        reused = 0
        missing: list[tuple[BufferKey, int]] = []
        for key, n, _ in wanted:
            if key in slots:
                reused += n
            else:
                missing.append((key, n))
        allocated = 0
        new_slab_id = -1
        # Not for device pieces.  Measured on an H200 host, 32 x 32 MiB + 2000 x 4 KiB bf16:
        # staging into a new pinned slab blocked 582 ms, into private pageable memory 951 ms
        # (a fresh allocation there faults its pages in more slowly than the slab's).
        defer = defer_new_slab and device_type is None
        if missing:
            allocated = sum(_align(n) for _, n in missing)
            new_slab_id = self._next_id
            self._next_id += 1
            if not defer:
                self._slabs[new_slab_id] = _Slab(new_slab_id, allocated, device_type)
            offset = 0
            for key, n in missing:
                slots[key] = (new_slab_id, offset)
                offset += _align(n)
        self._release_unused({slots[key][0] for key, _, _ in wanted}, keep=new_slab_id)
        slots = self._slots

        piece_slots: list[_Slot] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        deferred: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for key, _, view in wanted:
                slab_id, offset = slots[key]
                piece_slots.append((slab_id, offset, key[2], key[3]))
                if slab_id == new_slab_id and defer:
                    # A fresh shared slab costs a page fault per 4 KiB on first write (up to
                    # ~2x a memcpy; 1.2x a clone for 2000 x 64 KiB on this host), while a
                    # clone mostly lands in heap memory the allocator has already faulted
                    # in: the training process pays only the clone, and complete() moves
                    # the bytes into the slab in the background.
                    deferred[len(piece_slots) - 1] = view.clone()
                    continue
                dsts.append(self._slabs[slab_id].view(offset, key[2], key[3]))
                srcs.append(view)
        self._copy(dsts, srcs, device_type)
        if deferred:
            self._pending = (new_slab_id, allocated, piece_slots, deferred)

        staged = StagedStateDict(slab_ids=frozenset([*self._slabs, *([new_slab_id] if deferred else [])]))
        tensor_leaves: dict[str, tuple[str, Any]] = {}
        object_fqns: list[str] = []
        for fqn, info in leaves:
            if info is None:
                staged.leaves[fqn] = ("object", DataCopier.copy(flat[fqn]))
                object_fqns.append(fqn)
                continue
            ts, keys = info
            refs: list[PieceRef] = [
                (box.offsets, box.sizes, -1, 0) if key is None else (box.offsets, box.sizes, *slots[key])
                for (box, _), key in zip(ts.pieces, keys)
            ]
            entry = ("tensor", (tuple(ts.global_shape), ts.dtype, ts.ragged, refs))
            staged.leaves[fqn] = tensor_leaves[fqn] = entry
        staged_bytes = sum(n for _, n, _ in wanted)
        self._layout = None
        if reusable:
            # with a deferred slab, complete() makes the destination views once it exists
            self._layouts_made += 1
            self._layout = _Layout(tuple(flat), checks, [] if deferred else dsts, tensor_leaves,
                                   tuple(object_fqns), device_type, staged_bytes, self._layouts_made)
            staged.layout_id = self._layouts_made
            if device_type is not None:
                # made now, with the first save's copy (a few ms for 2000 pieces), not by
                # the next save the training loop waits for
                self._layout.pack = _DevicePack(dsts, srcs)
        stats = StagingStats(staged_bytes, reused, allocated, any(s.pinned for s in self._slabs.values()))
        return staged, stats

    def complete(self) -> None:
        """Allocate the slab a deferred stage left pending and move its pieces there.

        Called before the writer maps the slabs (and by anything that reads them).  The
        pieces move in batches of about :data:`_FILL_BATCH_BYTES`, and each batch's
        private copies are freed and their memory handed back to the operating system
        before the next batch: see :func:`release_free_heap`.
        """
        with self._pending_lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            slab_id, nbytes, slots, private = pending
            self._slabs[slab_id] = _Slab(slab_id, nbytes, None)
            dsts = [self._slabs[sid].view(offset, sizes, dtype) for sid, offset, sizes, dtype in slots]
            batch_dsts: list[torch.Tensor] = []
            batch_srcs: list[torch.Tensor] = []
            batch_bytes = 0
            for position in list(private):
                src = private.pop(position)
                batch_dsts.append(dsts[position])
                batch_srcs.append(src)
                batch_bytes += src.nbytes
                if batch_bytes >= _FILL_BATCH_BYTES or not private:
                    torch._foreach_copy_(batch_dsts, batch_srcs)
                    del src
                    batch_dsts, batch_srcs, batch_bytes = [], [], 0  # frees this batch's private copies
                    release_free_heap()
            if self._layout is not None:
                self._layout.dsts = dsts

    def _release_unused(self, live: set[int], keep: int = -1) -> None:
        """Release the slabs none of ``live`` (and not ``keep``); forget their slots."""
        for slab_id in [i for i in self._slabs if i not in live and i != keep]:
            self._slabs.pop(slab_id).release()
        self._slots = {k: v for k, v in self._slots.items() if v[0] in self._slabs or v[0] == keep}

    @staticmethod
    def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device_type: Optional[str]) -> None:
        if not dsts:
            return
        with torch.no_grad():
            if device_type is None:
                # one C++ loop instead of a Python call per piece (optimizer states have thousands)
                torch._foreach_copy_(dsts, srcs)
                return
            # Into page-locked memory the copy engine works asynchronously: queue every
            # device -> host copy on the current stream (one fused call), then wait for
            # that stream only, before the writer process may read the slots.  A first
            # save copies piece by piece: gathering the small pieces on the device first
            # pays off only with views made once (_DevicePack, for the saves after).
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        StagingArena._wait_for_copies({src.device for src in srcs if not src.is_cpu})

    @staticmethod
    def _wait_for_copies(devices: set[torch.device]) -> None:
        """Wait for the copies queued on ``devices`` (their current streams only)."""
        for device in devices:
            stream = torch.accelerator.current_stream(device)
            event = torch.Event(device=device)
            event.record(stream)
            event.synchronize()

    def clear(self) -> None:
        """Release every slab (the next save allocates again)."""
        self._pending = None
        for slab in self._slabs.values():
            slab.release()
        self._slabs.clear()
        self._slots.clear()
        self._layout = None
        self._whole_local.clear()


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
