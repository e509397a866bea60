"""Local load plans of tensors that share a chunk layout (their reads are computed once
per layout and piece) equal a brute-force reference computed tensor by tensor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.errors import MissingRegionError
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)


def _grid(shape, parts):
    """Chunks of ``shape`` cut into ``parts[d]`` near-equal runs along each dim, row-major."""
    runs = []
    for size, n in zip(shape, parts):
        cuts = [size * i // n for i in range(n + 1)]
        runs.append([(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a])
    return [ChunkStorageMetadata(tuple(o for o, _ in combo), tuple(s for _, s in combo))
            for combo in itertools.product(*runs)]


def _reference(fqn, md, pieces):
    """Every (piece, stored chunk) overlap, by brute force over all chunks."""
    out = []
    for box in pieces:
        covered = 0
        for pos, chunk in enumerate(md.chunks):
            lo = [max(a, b) for a, b in zip(box.offsets, chunk.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, chunk.offsets, chunk.sizes)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            sizes = tuple(h - lo_ for lo_, h in zip(lo, hi))
            covered += math.prod(sizes)
            out.append((fqn, box.offsets, tuple(a - b for a, b in zip(lo, box.offsets)), chunk.offsets, pos,
                        tuple(a - b for a, b in zip(lo, chunk.offsets)), sizes))
        assert covered == math.prod(box.sizes)
    return out


LAYOUTS = [((12, 8), (2, 1)), ((12, 8), (1, 2)), ((12, 8), (3, 2)), ((12, 8), (2, 1)), ((12, 8), (1, 2)),
           ((9, 7), (3, 1)), ((12, 8), (3, 2))]


@pytest.mark.parametrize("target_parts", [(2, 1), (1, 2), (3, 3), (1, 1)])
def test_plans_of_shared_layouts_equal_the_reference(target_parts):
    sd_md, flat, expected = {}, {}, []
    for i, (shape, parts) in enumerate(LAYOUTS):
        fqn = f"layer{i}.w"
        md = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), _grid(shape, parts))
        sd_md[fqn] = md
        pieces = [ChunkBox(c.offsets, c.sizes) for c in _grid(shape, target_parts)][1::2] or [
            ChunkBox((0, 0), shape)]
        flat[fqn] = TensorShards(shape, torch.float32, [(box, torch.empty(box.sizes)) for box in pieces])
        expected += _reference(fqn, md, pieces)
    plan, _ = create_local_load_plan(flat, Metadata(sd_md))
    got = [(it.dest_index.fqn, it.dest_index.offset, it.dest_offsets, it.storage_index.offset,
            it.storage_index.index, it.storage_offsets, it.lengths) for it in plan.items]
    assert got == expected


def test_a_tensor_missing_a_chunk_is_refused_after_one_with_the_same_pieces():
    shape = (8, 4)
    whole = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), _grid(shape, (2, 1)))
    half = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), _grid(shape, (2, 1))[:1])
    target = TensorShards(shape, torch.float32, [(ChunkBox((0, 0), (8, 2)), torch.empty(8, 2))])
    plan, _ = create_local_load_plan({"a": target}, Metadata({"a": whole, "b": half}))
    assert len(plan.items) == 2
    with pytest.raises(MissingRegionError, match=r"'b'.*offsets=\[0, 0\] sizes=\[8, 2\] \(8 of 16"):
        create_local_load_plan({"a": target, "b": target}, Metadata({"a": whole, "b": half}))
