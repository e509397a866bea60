"""The staged state dict as the writer receives it (slab offsets, no tensor data):
:data:`PieceRef`, :class:`StagedStateDict`, :func:`materialize`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel_dcp.core import ChunkBox, TensorShards

from .slabs import slab_view

__all__ = ["PieceRef", "StagedStateDict", "materialize"]

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
