"""The repeated-layout strategy: a save with the last one's flat keys and tensor geometry
checks each leaf and copies, with none of a first staging's per-piece work.  Exports
:data:`LeafCheck`, :func:`leaf_check`, :class:`RepeatedLayout`, :class:`DevicePack`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import RaggedShard, TensorShards, to_tensor_shards
from hyper_parallel_dcp.core.layout import is_tensor_leaf

from ._torch_compat import dtensor_class, dtensor_local, dtensor_spec, foreach_copy
from .staged import align, copy_into_slots, wait_for_copies

__all__ = ["DevicePack", "LeafCheck", "RepeatedLayout", "leaf_check"]

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
