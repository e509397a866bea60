"""Chunk exchanges planned in one process: who reads which chunk, and the messages both
sides of every pair compute alike (``core.reader_assignment``, ``broadcast.schedule``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hyper_parallel_dcp.broadcast.schedule import exchange_messages
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.reader_assignment import (
    ReaderAssignment,
    SplitReads,
    apply_assignment,
    assign_reads,
    exchanged_reads,
    read_layout,
)
from hyper_parallel_dcp.core.save_planning import build_metadata, create_local_save_plan


def _even(total: int, parts: int) -> list[tuple[int, int]]:
    cuts = [total * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts)]


def _plans(shapes: dict, save_world: int, load_world: int):
    """Row blocks over ``save_world`` stored, column blocks over ``load_world`` loaded."""
    save_flat = {name: TensorShards(shape, torch.float32,
                                    [(ChunkBox((o, 0), (n, shape[1])), torch.zeros(n, shape[1]))
                                     for o, n in _even(shape[0], save_world)])
                 for name, shape in shapes.items()}
    metadata = build_metadata([create_local_save_plan(save_flat)[0]])
    plans = []
    for rank in range(load_world):
        flat = {}
        for name, (rows, cols) in shapes.items():
            o, n = _even(cols, load_world)[rank]
            flat[name] = TensorShards((rows, cols), torch.float32, [(ChunkBox((0, o), (rows, n)), torch.zeros(rows, n))])
        plans.append(create_local_load_plan(flat, metadata)[0])
    return plans, metadata


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 2), (4, 2), (2, 4), (3, 4)])
def test_every_chunk_is_read_once_by_a_member_and_the_pairs_agree(save_world: int, load_world: int) -> None:
    shapes = {"a": (12, 10), "b": (7, 9), "c": (16, 4)}
    plans, metadata = _plans(shapes, save_world, load_world)
    splits = [read_layout(p, metadata)[1] for p in plans]
    replies = assign_reads([()] * load_world, splits)
    finals = [apply_assignment(p, metadata, s, a, r) for r, (p, s, a) in enumerate(zip(plans, splits, replies))]
    answers = [f.planner_data.exchanges for f in finals]
    readers = {}
    for rank, (final, x) in enumerate(zip(finals, answers)):
        for exchange in x:
            key = (exchange.storage_index.fqn, exchange.storage_index.offset)
            readers.setdefault(key, set()).add(exchange.reader)
            # the whole chunk, one run of its rows
            assert exchange.rows == (0, exchange.shape[0])
        served = [item for item, ex in exchanged_reads(final) if ex is not None]
        assert len(served) == len(splits[rank])  # every column slice; a 1-row chunk's slice is one run
        assert all(item.source == ex.reader for item, ex in exchanged_reads(final) if ex is not None)
    chunks = {(fqn, tuple(c.offsets)) for fqn, md in metadata.state_dict_metadata.items() for c in md.chunks
              if c.sizes[0] > 1}
    assert set(readers) == chunks and all(len(r) == 1 for r in readers.values())
    # byte balance: no reader holds more than the largest chunk above another
    load = [0] * load_world
    for x in answers:
        for exchange in x:
            if exchange.pieces is not None:
                load[exchange.reader] += math.prod(exchange.shape) * 4
    biggest = max(math.prod(s) * 4 for s in shapes.values())
    assert max(load) - min(load) <= biggest
    # the messages of each pair, on both sides: same tags, sizes, pieces (chunks by name)
    received = [[sorted({(i.storage_offsets, i.lengths) for i, ex in exchanged_reads(f)
                         if ex is not None and ex.storage_index == exchange.storage_index})
                 for exchange in x] for f, x in zip(finals, answers)]
    messages = [exchange_messages(x, rank, received[rank], 64) for rank, x in enumerate(answers)]

    def named(rank: int, message) -> tuple:
        x = answers[rank]
        return (message.tag, message.nbytes,
                tuple((x[i].storage_index.fqn, x[i].storage_index.offset, o, n, at) for i, o, n, at in message.pieces))

    for sender in range(load_world):
        for receiver in range(load_world):
            if sender == receiver:
                continue
            sent = [named(sender, m) for m in messages[sender][0] if m.peer == receiver]
            got = [named(receiver, m) for m in messages[receiver][1] if m.peer == sender]
            assert sent == got
            assert all(nbytes <= 64 or len(pieces) == 1 for _, nbytes, pieces in sent)


def test_a_chunk_only_one_rank_needs_slices_of_is_left_alone() -> None:
    plans, metadata = _plans({"a": (8, 6)}, 2, 2)
    splits = [read_layout(p, metadata)[1] for p in plans]
    assert all(splits)
    alone = [splits[0], SplitReads(np.zeros((0, 4), dtype=np.int64))]
    replies = assign_reads([(), ()], alone)
    assert all((per_row[:, 0] == -1).all() and not len(pieces) for _, (per_row, pieces) in replies)
    finals = [apply_assignment(p, metadata, s, a, r) for r, (p, s, a) in enumerate(zip(plans, alone, replies))]
    assert [f.items for f in finals] == [p.items for p in plans]
    assert all(f.planner_data == ReaderAssignment() for f in finals)
