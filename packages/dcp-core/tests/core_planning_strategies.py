"""Hypothesis strategies the planning tests share: ``from core_planning_strategies import partition``."""

from __future__ import annotations

from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import ChunkBox, full_box


@st.composite
def partition(draw, shape, max_parts=6):
    """Boxes that partition ``full_box(shape)`` (random guillotine cuts)."""
    parts = [full_box(shape)]
    for _ in range(draw(st.integers(0, max_parts - 1))):
        i = draw(st.integers(0, len(parts) - 1))
        box = parts[i]
        dims = [d for d, s in enumerate(box.sizes) if s > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, box.sizes[d] - 1))
        lo = ChunkBox(box.offsets, box.sizes[:d] + (cut,) + box.sizes[d + 1:])
        hi = ChunkBox(box.offsets[:d] + (box.offsets[d] + cut,) + box.offsets[d + 1:],
                      box.sizes[:d] + (box.sizes[d] - cut,) + box.sizes[d + 1:])
        parts[i:i + 1] = [lo, hi]
    return parts
