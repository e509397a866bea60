"""``RaggedShard``: a rank's contiguous ranges of the row-major flattening of a tensor.

ZeRO, Megatron's distributed optimizer and flat-parameter FSDP shard by flat element
ranges; each range is stored as at most ``2 * ndim - 1`` boxes
(:func:`~hyper_parallel_dcp.core.chunks.flat_range_to_boxes`), so it loads into any layout.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .chunks import ChunkBox, flat_range_to_boxes

__all__ = ["RaggedShard"]


class RaggedShard:
    """A state-dict leaf holding flat ranges ``[start, end)`` of a global tensor.

    ``local_tensor`` is 1-D, the ranges' elements concatenated in order (a load fills it in
    place).  Ranges must be sorted, disjoint and inside the tensor (empty ones allowed);
    raises ``ValueError`` when the ranges and the local tensor disagree.
    """

    def __init__(
        self,
        local_tensor: torch.Tensor,
        global_shape: Sequence[int],
        flat_ranges: Sequence[tuple[int, int]],
    ) -> None:
        global_shape = tuple(int(d) for d in global_shape)
        ranges = tuple((int(s), int(e)) for s, e in flat_ranges)
        total = math.prod(global_shape)
        prev_end = 0
        for start, end in ranges:
            if not 0 <= start <= end <= total:
                raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements {global_shape}")
            if start < prev_end:
                raise ValueError(f"flat ranges must be sorted and disjoint, got {list(ranges)}")
            prev_end = end
        if local_tensor.dim() != 1:
            raise ValueError(f"RaggedShard.local_tensor must be 1-D, got shape {tuple(local_tensor.shape)}")
        needed = sum(e - s for s, e in ranges)
        if local_tensor.numel() != needed:
            raise ValueError(
                f"RaggedShard.local_tensor has {local_tensor.numel()} elements but the flat ranges "
                f"{list(ranges)} hold {needed}"
            )
        self.local_tensor = local_tensor
        self.global_shape = global_shape
        self.flat_ranges = ranges

    @classmethod
    def from_rows(cls, local_tensor: torch.Tensor, global_shape: Sequence[int], row_start: int) -> RaggedShard:
        """Uneven row sharding: ``local_tensor`` holds rows ``[row_start, row_start + rows)``.

        ``local_tensor`` has shape ``(rows, *global_shape[1:])`` and must be contiguous, so
        that a load writes through to it.
        """
        global_shape = tuple(int(d) for d in global_shape)
        if not global_shape:
            raise ValueError("RaggedShard.from_rows needs a tensor of at least one dimension")
        if tuple(local_tensor.shape[1:]) != global_shape[1:]:
            raise ValueError(
                f"rows of shape {tuple(local_tensor.shape[1:])} do not match global shape {global_shape}"
            )
        if not local_tensor.is_contiguous():
            raise ValueError("RaggedShard.from_rows needs a contiguous local tensor")
        inner = math.prod(global_shape[1:])
        rows = local_tensor.shape[0]
        return cls(local_tensor.view(-1), global_shape, [(row_start * inner, (row_start + rows) * inner)])

    @property
    def dtype(self) -> torch.dtype:
        return self.local_tensor.dtype

    def boxes(self) -> list[tuple[ChunkBox, int]]:
        """The stored boxes of this shard with the position of each box in ``local_tensor``."""
        out = []
        pos = 0
        for start, end in self.flat_ranges:
            for box in flat_range_to_boxes(self.global_shape, start, end):
                out.append((box, pos))
                pos += box.volume
        return out

    def __repr__(self) -> str:
        return f"RaggedShard(global_shape={self.global_shape}, flat_ranges={list(self.flat_ranges)}, dtype={self.dtype})"
