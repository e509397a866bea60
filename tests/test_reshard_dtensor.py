"""DTensor checkpoints saved on one layout and loaded on another, with real gloo ranks.

TP4 → TP2, TP4 → DP2×TP2, DP2×TP2 → TP2, Shard(0) → Shard(1), uneven shapes over 3 and 4
ranks, world 4 → a single process with ``no_dist=True``.  The reference of every tensor is
a seeded random tensor that each rank (and the test) computes independently; each load
is checked through ``full_tensor()`` and through the local shard torch itself cuts.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

SHAPES = {
    "tp_rows": (10, 6),  # 10 rows: 3,3,3,1 over 4 ranks; 4,4,2 over 3
    "tp_cols": (5, 9),
    "emb": (13, 4),  # bfloat16, odd row count
    "rep": (4, 3),
}
DTYPES = {"emb": torch.bfloat16}


def reference(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 31)
    return torch.randn(*SHAPES[name], generator=gen).to(DTYPES.get(name, torch.float32))


def objects() -> dict:
    return {"step": 17, "meta": {"lr": 0.25, "betas": (0.9, 0.95), "name": "run-1"}}


def object_placeholders() -> dict:
    """Same nesting as :func:`objects`, other values: a load replaces every leaf."""
    return {"step": None, "meta": {"lr": None, "betas": None, "name": None}}


def layout(name: str):
    """Mesh shape and placements for each tensor, per named layout."""
    from torch.distributed.tensor import Replicate, Shard

    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    table = {
        "tp4": ((4,), {"tp_rows": [s0], "tp_cols": [s1], "emb": [s0], "rep": [r]}),
        "dp2tp2": ((2, 2), {"tp_rows": [r, s0], "tp_cols": [r, s1], "emb": [s0, s1], "rep": [r, r]}),
        "swap4": ((4,), {"tp_rows": [s1], "tp_cols": [s0], "emb": [s1], "rep": [s0]}),
        "tp3": ((3,), {"tp_rows": [s0], "tp_cols": [s1], "emb": [s0], "rep": [r]}),
        "tp2": ((2,), {"tp_rows": [s0], "tp_cols": [s1], "emb": [s0], "rep": [r]}),
    }
    return table[name]


def state_dict(layout_name: str, *, empty: bool = False) -> dict:
    """The model laid out as ``layout_name``; ``empty`` gives a NaN/zero target to load into."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh_shape, placements = layout(layout_name)
    mesh = init_device_mesh("cpu", mesh_shape)
    sd: dict = {"model": {}}
    for name in SHAPES:
        full = reference(name)
        if empty:
            full = torch.full_like(full, float("nan"))
        sd["model"][name] = distribute_tensor(full, mesh, placements[name], src_data_rank=None)
    sd["plain"] = torch.full((6,), float("nan")) if empty else torch.arange(6.0)
    sd["extra"] = object_placeholders() if empty else objects()
    return sd


def check_loaded(sd: dict, layout_name: str) -> None:
    """Full tensors equal the references; local shards equal what torch itself cuts."""
    expected = state_dict(layout_name)
    for name in SHAPES:
        got = sd["model"][name]
        assert got.dtype == reference(name).dtype
        assert torch.equal(got.full_tensor(), reference(name)), f"{name} differs after load into {layout_name}"
        assert torch.equal(got.to_local(), expected["model"][name].to_local()), f"local shard of {name} differs"
    assert torch.equal(sd["plain"], torch.arange(6.0))
    assert sd["extra"] == objects()


def _save_and_reshard_on_four(rank: int, world_size: int, root: str) -> dict:
    import hyper_parallel_dcp as dcp

    md_tp4 = dcp.save(state_dict("tp4"), checkpoint_id=f"{root}/tp4")
    md_dp = dcp.save(state_dict("dp2tp2"), checkpoint_id=f"{root}/dp2tp2")
    for src, dst in [("tp4", "dp2tp2"), ("tp4", "swap4"), ("dp2tp2", "tp4"), ("dp2tp2", "swap4")]:
        target = state_dict(dst, empty=True)
        dcp.load(target, checkpoint_id=f"{root}/{src}")
        check_loaded(target, dst)
    return {
        f"{prefix}:{fqn}": [(list(c.offsets), list(c.sizes)) for c in md.state_dict_metadata[fqn].chunks]
        for md, prefix in [(md_tp4, "tp4"), (md_dp, "dp")]
        for fqn in [f"model.{n}" for n in SHAPES]
    }


def _save_and_reshard_on_three(rank: int, world_size: int, root: str) -> None:
    import hyper_parallel_dcp as dcp

    for src in ["tp4", "dp2tp2"]:
        target = state_dict("tp3", empty=True)
        dcp.load(target, checkpoint_id=f"{root}/{src}")
        check_loaded(target, "tp3")
    dcp.save(state_dict("tp3"), checkpoint_id=f"{root}/tp3")


def _reshard_on_two(rank: int, world_size: int, root: str) -> None:
    import hyper_parallel_dcp as dcp

    for src in ["tp4", "dp2tp2", "tp3"]:
        target = state_dict("tp2", empty=True)
        dcp.load(target, checkpoint_id=f"{root}/{src}")
        check_loaded(target, "tp2")


def _rows(total: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk row ranges: ceil-sized pieces, trailing ones possibly short or absent."""
    size = math.ceil(total / parts)
    return [(start, min(size, total - start)) for start in range(0, total, size)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reshard"))


@pytest.fixture(scope="module")
def four(root):
    return run_distributed(_save_and_reshard_on_four, 4, root, timeout=240)


def test_tp4_and_dp2tp2_save_and_reshard_among_four_ranks(four):
    chunks = four[0]
    assert all(result == chunks for result in four)  # the returned metadata is global on every rank
    # TP4, 10 rows → 3,3,3,1; 9 columns → 3,3,3,0 (the empty shard stores nothing)
    assert chunks["tp4:model.tp_rows"] == [([s, 0], [n, 6]) for s, n in _rows(10, 4)]
    assert chunks["tp4:model.tp_cols"] == [([0, s], [5, n]) for s, n in _rows(9, 4)]
    assert chunks["tp4:model.emb"] == [([s, 0], [n, 4]) for s, n in _rows(13, 4)]
    assert chunks["tp4:model.rep"] == [([0, 0], [4, 3])]  # replicated on 4 ranks, stored once
    # DP2×TP2: the TP halves are replicated over DP and stored once each
    assert chunks["dp:model.tp_rows"] == [([0, 0], [5, 6]), ([5, 0], [5, 6])]
    assert chunks["dp:model.emb"] == [([0, 0], [7, 2]), ([0, 2], [7, 2]), ([7, 0], [6, 2]), ([7, 2], [6, 2])]
    assert chunks["dp:model.rep"] == [([0, 0], [4, 3])]


def test_four_to_three_ranks_uneven(four, root):
    run_distributed(_save_and_reshard_on_three, 3, root, timeout=240)


def test_four_and_three_to_two_ranks(four, root):
    if not os.path.isdir(f"{root}/tp3"):  # when run alone
        run_distributed(_save_and_reshard_on_three, 3, root, timeout=240)
    run_distributed(_reshard_on_two, 2, root, timeout=240)


def test_world_four_to_single_process_no_dist(four, root):
    import hyper_parallel_dcp as dcp

    for src in ["tp4", "dp2tp2"]:
        target = {"model": {n: torch.zeros(SHAPES[n], dtype=reference(n).dtype) for n in SHAPES},
                  "plain": torch.zeros(6), "extra": object_placeholders()}
        dcp.load(target, checkpoint_id=f"{root}/{src}", no_dist=True)
        for n in SHAPES:
            assert torch.equal(target["model"][n], reference(n)), n
        assert torch.equal(target["plain"], torch.arange(6.0))
        assert target["extra"] == objects()
    # only part of the keys: load fills what the caller asks for and nothing else
    partial = {"model": {"emb": torch.zeros(13, 4, dtype=torch.bfloat16)}}
    dcp.load(partial, checkpoint_id=f"{root}/tp4", no_dist=True)
    assert set(partial["model"]) == {"emb"} and torch.equal(partial["model"]["emb"], reference("emb"))
