"""The local load plan looks stored chunks up in the metadata's columns.

A rank's plan must not build (or sort) every stored chunk of the tensors it touches: the
chunk index bisects into the columns and builds boxes only near the rank's own pieces.
The read items are the same as from plain, per-chunk metadata, sorted or not.
"""

from __future__ import annotations

import random

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import (
    ChunkTable,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.save_planning import build_metadata


def _grid_metadata(rows: int, cols: int) -> Metadata:
    """A (rows*4, cols*3) tensor stored as rows × cols chunks of 4 × 3, one rank each."""
    plans = [SavePlan((WriteItem(MetadataIndex("w", (4 * r, 3 * c)), WriteItemType.TENSOR, (4, 3),
                                 (4 * rows, 3 * cols), "float32", 48),))
             for r in range(rows) for c in range(cols)]
    return build_metadata(plans)


def _target(shape, boxes) -> dict[str, TensorShards]:
    return {"w": TensorShards(shape, torch.float32, [(b, torch.empty(b.sizes)) for b in boxes])}


def _reads(plan):
    return [(it.dest_index, it.dest_offsets, it.storage_index, it.storage_index.index, it.storage_offsets, it.lengths)
            for it in plan.items]


def test_a_rank_reads_without_building_every_chunk(monkeypatch):
    built = []
    real_getitem = ChunkTable.__getitem__
    monkeypatch.setattr(ChunkTable, "__getitem__", lambda self, pos: built.append(pos) or real_getitem(self, pos))
    real_iter = ChunkTable.__iter__
    monkeypatch.setattr(ChunkTable, "__iter__", lambda self: built.append("all") or real_iter(self))
    for metadata in (_grid_metadata(64, 8), metadata_from_json(metadata_to_json(_grid_metadata(64, 8)))):
        md = metadata.state_dict_metadata["w"]
        target = _target((256, 24), [ChunkBox((10, 5), (7, 10))])
        built.clear()
        plan = create_local_load_plan(target, metadata)[0]
        assert isinstance(md.chunks, ChunkTable) and built == [], built  # no object per stored chunk
        # reference: the same metadata with plain chunk objects
        plain = Metadata({"w": TensorStorageMetadata(md.properties, md.size, list(md.chunks))})
        assert _reads(plan) == _reads(create_local_load_plan(target, plain)[0])
        # rows 8..19 × cols 3..14 of the grid: chunk rows 2..4, chunk cols 1..4
        assert sorted(it.storage_index.offset for it in plan.items) == [
            (4 * r, 3 * c) for r in (2, 3, 4) for c in (1, 2, 3, 4)]


def test_unsorted_chunks_give_the_same_reads_as_sorted():
    metadata = _grid_metadata(6, 5)
    md = metadata.state_dict_metadata["w"]
    chunks = list(md.chunks)
    shuffled = chunks[:]
    random.Random(3).shuffle(shuffled)
    sorted_md = Metadata({"w": TensorStorageMetadata(md.properties, md.size, chunks)})
    shuffled_md = Metadata({"w": TensorStorageMetadata(md.properties, md.size, shuffled)})
    boxes = [ChunkBox((0, 0), (24, 15)), ChunkBox((3, 2), (9, 9)), ChunkBox((23, 14), (1, 1))]
    for box in boxes:
        a = create_local_load_plan(_target((24, 15), [box]), sorted_md)[0]
        b = create_local_load_plan(_target((24, 15), [box]), shuffled_md)[0]
        assert [r[:3] + r[4:] for r in _reads(a)] == [r[:3] + r[4:] for r in _reads(b)]
        # the position hint points at the chunk in the metadata's own list
        for it in b.items:
            assert shuffled[it.storage_index.index].offsets == it.storage_index.offset
