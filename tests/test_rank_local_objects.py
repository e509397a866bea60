"""Rank-local objects (RNG state, data-loader position) come back to the rank that saved them.

SPEC §4: loading per-rank metadata (no ``.metadata``), rank r gets the copy rank r saved;
a rank whose number saved no copy gets the lowest saving rank's copy.  The same view is
used by ``verify_checkpoint`` and the ``hp-dcp`` tools.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed


def _state(rank: int) -> dict:
    return {"meta": {"rank_specific": f"rank{rank}", "step": 11}, "w": torch.arange(8.0)}


def _save_local(rank: int, world_size: int, path: str) -> None:
    import hyper_parallel_dcp as dcp

    dcp.save(_state(rank), checkpoint_id=path, use_collectives=False)


def _load_plain(rank: int, world_size: int, path: str) -> tuple:
    import hyper_parallel_dcp as dcp

    target = {"meta": {"rank_specific": "", "step": 0}, "w": torch.zeros(8)}
    dcp.load(target, checkpoint_id=path)
    return target["meta"], target["w"].tolist()


@pytest.mark.distributed
def test_each_rank_gets_its_own_object_back(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_local, 2, ckpt)
    assert not (Path(ckpt) / ".metadata").exists()
    got = run_distributed(_load_plain, 2, ckpt)
    for rank, (meta, w) in enumerate(got):
        assert meta == {"rank_specific": f"rank{rank}", "step": 11}
        assert w == list(range(8))
    # a third rank saved no copy: it gets the lowest saving rank's
    got3 = run_distributed(_load_plain, 3, ckpt)
    assert [m["rank_specific"] for m, _ in got3] == ["rank0", "rank1", "rank0"]


def test_tools_see_every_rank_copy(tmp_path: Path) -> None:
    import shutil

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.cli.diff import diff_checkpoints
    from hyper_parallel_dcp.cli.inspect_ckpt import describe_checkpoint
    from hyper_parallel_dcp.storage_fs import load_checkpoint_metadata
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint
    from hyper_parallel_dcp.storage_fs.metadata_io import load_rank_metadata

    ckpt = tmp_path / "ckpt"
    run_distributed(_save_local, 2, str(ckpt))
    parts = load_rank_metadata(ckpt)
    assert sorted(parts) == [0, 1]
    merged, is_global = load_checkpoint_metadata(ckpt)
    assert not is_global and sorted(merged.rank_objects["meta.rank_specific"]) == [0, 1]
    assert merged.object_storage("meta.rank_specific", 1).relative_path == "_rank1_.bytes"
    assert merged.object_storage("meta.rank_specific", 5).relative_path == "_rank0_.bytes"
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems
    # both copies of the two objects, and the replicated tensor once
    assert report.chunks_checked == 5
    doc = describe_checkpoint(ckpt)
    assert doc["rank_local_objects"] == {"meta.rank_specific": [0, 1], "meta.step": [0, 1]}
    # a copy of the checkpoint whose rank-1 object differs: diff names that rank's copy
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    assert diff_checkpoints(ckpt, other, show_progress=False).identical
    dcp.save({"meta": {"rank_specific": "changed", "step": 11}, "w": torch.arange(8.0)},
             checkpoint_id=str(tmp_path / "r1"), no_dist=True)
    shutil.copy(tmp_path / "r1" / "_rank0_.bytes", other / "_rank1_.bytes")
    from dataclasses import replace

    from hyper_parallel_dcp.core.metadata import metadata_from_json, metadata_to_json

    # rank 1's metadata now points its objects at the changed copy (in format 2, as saved)
    md1 = metadata_from_json((other / "1.metadata").read_bytes())
    new = metadata_from_json((tmp_path / "r1" / ".metadata").read_bytes())
    storage = dict(md1.storage_data)
    for index, info in new.storage_data.items():
        if index.fqn.startswith("meta."):
            storage[index] = replace(info, relative_path="_rank1_.bytes")
    md1.storage_data = storage
    md1.files = {**md1.files, "_rank1_.bytes": new.files["_rank0_.bytes"]}
    (other / "1.metadata").write_text(metadata_to_json(md1))
    result = diff_checkpoints(ckpt, other, show_progress=False)
    by_fqn = {k.fqn: k for k in result.keys}
    assert by_fqn["meta.step"].equal
    assert not by_fqn["meta.rank_specific"].equal and "rank(s) [1]" in by_fqn["meta.rank_specific"].reason
