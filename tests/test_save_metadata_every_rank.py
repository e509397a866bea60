"""Every rank's ``save`` returns the global metadata the coordinator committed: rank 0
builds it, the other ranks get it as plain columns (``core.metadata.pack_metadata``) and
unpack it while the coordinator commits.  Needs the umbrella and the filesystem backend,
so it lives here rather than in dcp-core's own tests."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.metadata import TensorStorageMetadata
from hyper_parallel_dcp.core.testing import run_distributed


def _save_returns(rank: int, world_size: int, path: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import hyper_parallel_dcp as hp

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {f"layer{i}.w": distribute_tensor(torch.arange(32.0).view(8, 4) + i, mesh, [Shard(i % 2)],
                                           src_data_rank=None) for i in range(5)}
    sd["norm"] = distribute_tensor(torch.ones(6), mesh, [Replicate()], src_data_rank=None)
    sd["step"] = torch.tensor(3)
    sd["meta"] = {"lr": 0.1}
    md = hp.save(sd, checkpoint_id=path)
    from hyper_parallel_dcp.storage_fs.filesystem import load_checkpoint_metadata

    on_disk, _ = load_checkpoint_metadata(path)
    # plain data to compare across processes
    chunks = {fqn: [(c.offsets, c.sizes) for c in m.chunks] if isinstance(m, TensorStorageMetadata) else None
              for fqn, m in md.state_dict_metadata.items()}
    storage = sorted((k.fqn, k.offset, v.relative_path, v.offset, v.length, v.checksum, v.key)
                     for k, v in (md.storage_data or {}).items())
    disk_storage = sorted((k.fqn, k.offset, v.relative_path, v.offset, v.length, v.checksum, v.key)
                          for k, v in (on_disk.storage_data or {}).items())
    return chunks, storage, dict(md.files), storage == disk_storage and md == on_disk


@pytest.mark.distributed
def test_every_rank_returns_the_committed_metadata(tmp_path):
    out = run_distributed(_save_returns, 2, str(tmp_path / "ck"))
    assert out[0][:3] == out[1][:3]
    assert out[0][3] and out[1][3]  # equal to the .metadata committed on disk
    assert len(out[0][1]) == 5 * 2 + 1 + 1 + 1  # 5 sharded x 2 chunks, norm once, step, meta


def _load_counting_metadata_opens(rank: int, world_size: int, path: str, torch_path: str) -> tuple:
    import sys

    import hyper_parallel_dcp as hp

    opened: list[str] = []

    def count(event: str, args: tuple) -> None:  # every open(): builtins, io, os, pathlib
        if event == "open" and isinstance(args[0], (str, bytes)) and str(args[0]).endswith(".metadata"):
            opened.append(str(args[0]))

    sys.addaudithook(count)
    out = []
    for where in (path, torch_path):
        sd = {"w": torch.zeros(8, 4), "b": torch.zeros(6)}
        hp.load(sd, checkpoint_id=where)
        out.append((len(opened), torch.equal(sd["w"], torch.arange(32.0).view(8, 4)) and torch.equal(sd["b"],
                                                                                                    torch.ones(6))))
        opened.clear()
    return tuple(out)


@pytest.mark.distributed
def test_a_four_rank_load_opens_metadata_once(tmp_path):
    import warnings

    import torch.distributed.checkpoint as tdcp

    import hyper_parallel_dcp as hp

    sd = {"w": torch.arange(32.0).view(8, 4), "b": torch.ones(6)}
    hp.save(sd, checkpoint_id=tmp_path / "ours", no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    results = run_distributed(_load_counting_metadata_opens, 4, str(tmp_path / "ours"), str(tmp_path / "torch"))
    assert [r[0][1] and r[1][1] for r in results] == [True] * 4
    # the coordinator reads .metadata, every rank gets its bytes (ours) or its translation (torch DCP)
    assert [r[0][0] for r in results] == [1, 0, 0, 0]
    assert [r[1][0] for r in results] == [1, 0, 0, 0]
