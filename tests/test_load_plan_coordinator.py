"""Load planning through the coordinator on real gloo ranks.

Each rank sends the coordinator a compact description of its targets and gets back only
its own replica groups and readers; the final plans must be exactly those the all-gather
design computed (checked here against :func:`assign_readers` over all local plans, which
the property tests in ``test_reader_assignment.py`` hold against the old implementation).
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

WORLD = 4


def _reference():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 6, generator=g), "norm": torch.randn(6, generator=g),
            "emb": torch.randn(10, 4, generator=g).bfloat16(), "step": 5}


def _target(rank):
    """DP 2 × TP 2: ranks 0, 2 hold the top rows of w, ranks 1, 3 the bottom ones; norm and
    emb replicated everywhere; rank 3 also asks for the whole of w (a ragged target)."""
    from hyper_parallel_dcp.core.chunks import ChunkBox
    from hyper_parallel_dcp.core.layout import TensorShards

    half = rank % 2
    pieces = [(ChunkBox((4 * half, 0), (4, 6)), torch.zeros(4, 6))]
    if rank == 3:
        pieces = [(ChunkBox((0, 0), (4, 6)), torch.zeros(4, 6)), (ChunkBox((4, 0), (4, 6)), torch.zeros(4, 6))]
    return {"w": TensorShards((8, 6), torch.float32, pieces), "norm": torch.zeros(6),
            "emb": torch.zeros(10, 4, dtype=torch.bfloat16), "step": 0}


def _load(rank, world_size, path):
    import torch.distributed as dist

    from hyper_parallel_dcp.broadcast import make_read_executor
    from hyper_parallel_dcp.core.flatten import flatten_state_dict
    from hyper_parallel_dcp.core.layout import is_tensor_leaf
    from hyper_parallel_dcp.core.load_planning import create_local_load_plan
    from hyper_parallel_dcp.core.pipeline import load_state_dict
    from hyper_parallel_dcp.core.reader_assignment import assign_readers
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    seen = []
    inner = make_read_executor()

    def recording(plan, reader, planner, group):
        seen.append(plan)
        inner(plan, reader, planner, group)

    sd = _target(rank)
    load_state_dict(sd, FileSystemReader(path), read_executor=recording)
    ref = _reference()
    w_ok = all(torch.equal(view, ref["w"][box.offsets[0]:box.offsets[0] + box.sizes[0]])
               for box, view in sd["w"].pieces)
    values_ok = w_ok and torch.equal(sd["norm"], ref["norm"]) and torch.equal(sd["emb"], ref["emb"]) \
        and sd["step"] == 5
    # the reference: every rank's local plan, assigned in one process
    metadata = FileSystemReader(path).read_metadata()
    flat, _ = flatten_state_dict(_target(rank), is_tensor_leaf)
    local = create_local_load_plan(flat, metadata)[0]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, local)
    expected = assign_readers(everyone, metadata)[rank]
    final = seen[0]
    return (values_ok, final.items == expected.items, final.planner_data == expected.planner_data,
            inner.stats.replicated_shards)


@pytest.mark.distributed
def test_each_rank_gets_exactly_its_all_gather_plan_and_correct_values(tmp_path):
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    path = str(tmp_path / "ckpt")
    save_state_dict(_reference(), FileSystemWriter(path, sync_files=False), no_dist=True)
    results = run_distributed(_load, WORLD, path, timeout=300)
    for rank, (values_ok, items_same, groups_same, replicated) in enumerate(results):
        assert values_ok, rank
        assert items_same and groups_same, rank
        assert replicated >= 2, rank  # norm and emb at least
