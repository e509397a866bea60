"""Target specs of ``hp-dcp explain`` and the explain simulation, in one process.

Hand-built metadata with known chunk geometry; the expected byte counts are worked out in
the test from the row-major layout (first to last element touched), not by the code
under test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel_dcp.cli._common import UsageError
from hyper_parallel_dcp.cli.explain import explain_load
from hyper_parallel_dcp.cli.target_spec import parse_placement, parse_target_spec
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)


def test_placements_parse() -> None:
    assert parse_placement("Replicate") == Replicate() and parse_placement("Replicate()") == Replicate()
    assert parse_placement("Shard(1)") == Shard(1) and parse_placement("Shard(-1)") == Shard(-1)
    strided = parse_placement("_StridedShard(0, split_factor=4)")
    assert strided.dim == 0 and strided.split_factor == 4
    for bad in ("Partial", "Shard(x)", "Shard", 3):
        with pytest.raises(UsageError):
            parse_placement(bad)


def test_spec_mesh_forms_and_rules() -> None:
    spec = parse_target_spec({"mesh": {"pp": 2, "dp": 3, "tp": 2}, "default": {"tp": "Shard(0)"},
                              "rules": [{"match": "*.bias", "skip": True},
                                        {"match": "*.o.weight", "placements": {"tp": "Shard(1)", "dp": "Shard(0)"}}],
                              "load": ["model.*"]})
    assert spec.world_size == 12 and spec.mesh_dim_names == ("pp", "dp", "tp")
    # row-major: rank = ((pp * 3) + dp) * 2 + tp
    assert [spec.coordinate(r) for r in (0, 1, 2, 7, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 2, 1)]
    assert spec.placements_for("model.o.weight", 2) == ((Replicate(), Shard(0), Shard(1)), "*.o.weight")
    assert spec.placements_for("model.x.weight", 2) == ((Replicate(), Replicate(), Shard(0)), None)
    # a default Shard that does not fit a 0-d tensor falls back to Replicate
    assert spec.placements_for("model.scale", 0) == ((Replicate(), Replicate(), Replicate()), None)
    assert spec.wants("model.x.weight") and not spec.wants("model.x.bias") and not spec.wants("optim.x")
    assert parse_target_spec({"world_size": 3}).mesh_shape == (3,)
    assert parse_target_spec({"mesh": [2, 2], "mesh_dim_names": ["a", "b"],
                              "default": {"b": "Shard(0)"}}).default == (Replicate(), Shard(0))


@pytest.mark.parametrize("doc, message", [
    ({"mesh": [2, 2], "world_size": 3}, "differs from the mesh size 4"),
    ({}, "give 'world_size' or 'mesh'"),
    ({"mesh": [0]}, "positive integer"),
    ({"mesh": [2], "default": {"tp": "Shard(0)"}}, "need named mesh dimensions"),
    ({"mesh": {"dp": 2}, "default": {"tp": "Shard(0)"}}, "unknown mesh dimension"),
    ({"mesh": [2], "rules": [{"match": "*"}]}, "needs 'placements' or 'skip'"),
    ({"mesh": [2], "rulez": []}, "unknown key"),
    ({"mesh": [2], "expect": {"w": {"dtype": "float33"}}}, "not a torch dtype"),
])
def test_spec_errors(doc: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_target_spec(doc, source="t.json")


def _metadata() -> Metadata:
    """w: float32 [8, 6] stored as two row blocks [4, 6] in two files; b: bf16 [6] one chunk; obj."""
    w = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([8, 6]),
                              [ChunkStorageMetadata((0, 0), (4, 6)), ChunkStorageMetadata((4, 0), (4, 6))])
    b = TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size([6]), [ChunkStorageMetadata((0,), (6,))])
    storage = {
        MetadataIndex("w", (0, 0)): StorageInfo("_rank0_.safetensors", 100, 96, "0" * 16, "w@0"),
        MetadataIndex("w", (4, 0)): StorageInfo("_rank1_.safetensors", 100, 96, "0" * 16, "w@1"),
        MetadataIndex("b", (0,)): StorageInfo("_rank0_.safetensors", 196, 12, "0" * 16, "b@"),
        MetadataIndex("obj"): StorageInfo("_rank1_.bytes", 0, 50, "0" * 16),
    }
    return Metadata({"w": w, "b": b, "obj": BytesStorageMetadata()}, storage_data=storage,
                    files={"_rank0_.safetensors": 208, "_rank1_.safetensors": 196, "_rank1_.bytes": 50})


def test_explain_counts_row_and_column_spans() -> None:
    md = _metadata()
    before = copy.deepcopy(md)
    # columns: each rank takes 3 of the 6 columns of every row
    cols = explain_load(md, parse_target_spec({"mesh": [2], "default": ["Shard(1)"]}))
    assert md == before  # not modified
    # rank 0 reads cols 0..2 of each [4, 6] chunk: elements 0 .. 3*6+2 -> 21 elements; rank 1: 3 .. 3*6+5 -> 21
    w_col = 2 * 21 * 4
    b_whole = 6 * 2  # Shard(1) does not fit 1-d b: the default falls back to Replicate
    assert [r.bytes_read for r in cols.ranks] == [w_col + b_whole + 50] * 2
    assert [r.bytes_needed for r in cols.ranks] == [2 * 4 * 3 * 4 + b_whole + 50] * 2
    assert cols.stored_bytes == 8 * 6 * 4 + 6 * 2 + 50
    assert cols.over_read_factor == pytest.approx(2 * (w_col + b_whole + 50) / cols.stored_bytes)
    assert cols.ranks[0].files == ["_rank0_.safetensors", "_rank1_.bytes", "_rank1_.safetensors"]
    assert cols.broadcast_groups == 1 and cols.broadcast_bytes == b_whole and cols.problems == []
    # rows: rank r needs exactly chunk r -> no over-read of w, one file of tensors each
    rows = explain_load(md, parse_target_spec({"mesh": [2], "default": ["Shard(0)"]}))
    assert [r.bytes_read for r in rows.ranks] == [96 + 6 + 50] * 2
    assert rows.ranks[1].files == ["_rank0_.safetensors", "_rank1_.bytes", "_rank1_.safetensors"]
    # replicated over 4: without broadcast 4 full reads; read-once: one reader per destination shard (the
    # whole of w — both its stored chunks — is one shard), largest first to the least-loaded rank
    rep = explain_load(md, parse_target_spec({"world_size": 4}))
    assert [r.bytes_read for r in rep.ranks] == [192 + 12 + 50] * 4
    assert [r.read_once_bytes_read - 50 for r in rep.ranks] == [192, 12, 0, 0]
    assert rep.broadcast_groups == 2
    assert rep.broadcast_bytes == 192 + 12 and rep.broadcast_delivered_bytes == 3 * (192 + 12)
    assert sum(r.broadcast_received for r in rep.ranks) == rep.broadcast_delivered_bytes


def test_explain_problems() -> None:
    md = _metadata()
    exp = explain_load(md, parse_target_spec({
        "mesh": [2], "default": ["Shard(0)"],
        "rules": [{"match": "b", "placements": ["Shard(1)"]}],
        "expect": {"w": {"shape": [8, 7]}, "missing": {}}}))
    assert {(p.kind, p.fqn) for p in exp.problems} == {("placement", "b"), ("mismatch", "w"), ("missing_key", "missing")}
    mismatch = next(p for p in exp.problems if p.kind == "mismatch")
    assert mismatch.ranks == [0, 1] and "[8, 6]" in mismatch.message and "[8, 7]" in mismatch.message
    assert exp.tensors == 0 and exp.objects == 1 and [r.bytes_read for r in exp.ranks] == [50, 50]
    # a region nobody saved: drop w's second chunk
    md.state_dict_metadata["w"].chunks.pop()
    exp = explain_load(md, parse_target_spec({"mesh": [2], "default": ["Shard(0)"]}))
    region = [p for p in exp.problems if p.kind == "missing_region"]
    assert len(region) == 1 and region[0].fqn == "w" and region[0].ranks == [1]
