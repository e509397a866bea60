"""The staged state dict as the writer process receives it: slab ids and byte offsets, no
tensor data; :func:`materialize` turns it into ``{fqn: TensorShards}`` over the slabs.

Exports :data:`PieceRef`, :class:`StagedStateDict` and :func:`materialize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import ChunkBox, TensorShards

from .slabs import slab_view

__all__ = ["PieceRef", "StagedStateDict", "materialize"]

#: (global offsets, sizes, slab id or -1 for an empty piece, byte offset in the slab)
PieceRef = tuple[tuple[int, ...], tuple[int, ...], int, int]


@dataclass
class StagedStateDict:
    """What the writer process needs to rebuild a staged state dict.

    ``leaves`` keeps the flat order of the caller's state dict; each entry is
    ``("tensor", (global_shape, dtype, ragged, [PieceRef, ...]))`` or ``("object", copy)``.
    ``layout_id`` names the arena's layout these leaves were staged with (``None``: not
    reusable); with ``tensors_held``, ``leaves`` holds the object leaves only and the
    tensor leaves are those of the last whole description of that layout.
    """

    leaves: dict[str, tuple[str, Any]] = field(default_factory=dict)
    slab_ids: frozenset[int] = frozenset()
    layout_id: Optional[int] = None
    tensors_held: bool = False

    def without_tensors(self) -> StagedStateDict:
        """This description with its object leaves only, for a writer that holds the tensor
        leaves of ``layout_id``.  Raises ``ValueError`` without a layout id."""
        if self.layout_id is None:
            raise ValueError("a description without a layout id has no tensor leaves to hold")
        objects = {fqn: leaf for fqn, leaf in self.leaves.items() if leaf[0] == "object"}
        return StagedStateDict(objects, self.slab_ids, self.layout_id, tensors_held=True)

    def with_tensors_of(self, held: Optional[StagedStateDict]) -> StagedStateDict:
        """The whole description from one :meth:`without_tensors` made and the last whole
        description ``held``; itself when it is whole.  Raises ``RuntimeError`` when ``held``
        is not a whole description of the same layout."""
        if not self.tensors_held:
            return self
        if held is None or held.tensors_held or held.layout_id != self.layout_id:
            raise RuntimeError(f"async writer: a save refers to staged layout {self.layout_id}, which this writer "
                               f"does not hold ({None if held is None else held.layout_id})")
        leaves = dict(held.leaves)  # the state dict's flat order; object leaves replaced in place
        leaves.update(self.leaves)
        return StagedStateDict(leaves, self.slab_ids, self.layout_id)


def materialize(staged: StagedStateDict, slabs: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The flat staged state dict: ``{fqn: TensorShards over views of slabs}`` and objects.

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
