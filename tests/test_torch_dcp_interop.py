"""torch.distributed.checkpoint checkpoints, both ways, with real gloo ranks.

torch saves on 2 ranks (a TP model, and FSDP2 + Adam through ``get_state_dict``, both with
non-tensor objects); this library loads them on 4 ranks (another layout) and in one
process, and the values equal what torch's own single-process load gives.  Our 2-rank
checkpoint converted with ``dcp-to-torch-dcp`` loads with torch on 2 ranks into another
layout.  A 2-rank sub-group of a 4-rank job saves and loads with ``process_group``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

OBJECTS = {"step": 7, "extra": {"lr": 0.1, "tags": ["a", "b"]}}


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))


def _torch_saves(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    tp = parallelize_module(_mlp(0), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    tdcp.save({"model": tp.state_dict(), **OBJECTS}, checkpoint_id=f"{root}/torch_tp")

    model = _mlp(1)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    torch.manual_seed(5 + rank)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    tdcp.save({"model": msd, "optim": osd, **OBJECTS}, checkpoint_id=f"{root}/torch_fsdp")

    ours = {"w": distribute_tensor(torch.arange(60.0).view(6, 10), mesh, [Shard(0)]), "b": torch.arange(5.0),
            **OBJECTS}
    dcp.save(ours, checkpoint_id=f"{root}/ours")


def _targets(path: str, mesh=None) -> dict:
    """One target per stored key: a DTensor sharded on the LAST dim over ``mesh`` (the
    save sharded dim 0), or a full tensor without a mesh; ``None`` for objects."""
    from hyper_parallel_dcp.core.metadata import TensorStorageMetadata
    from hyper_parallel_dcp.storage_fs import storage_reader_for_path

    md = storage_reader_for_path(path).load_metadata()
    out: dict = {}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            out[fqn] = None
            continue
        full = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        if mesh is not None and full.ndim:
            from torch.distributed.tensor import Shard, distribute_tensor

            full = distribute_tensor(full, mesh, [Shard(full.ndim - 1)])
        out[fqn] = full
    return out


def _plain(sd: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}


def _ours_load_4(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in ("torch_tp", "torch_fsdp"):
        target = _targets(f"{root}/{name}", mesh)
        dcp.load(target, checkpoint_id=f"{root}/{name}")
        out[name] = _plain(target)
    # a sub-group of ranks 1 and 3 checkpoints on its own: group ranks name the files
    group = dist.new_group([1, 3])
    if rank in (1, 3):
        me = dist.get_rank(group)
        dcp.save({f"x{me}": torch.full((3,), float(rank)), "who": "sub"}, checkpoint_id=f"{root}/sub",
                 process_group=group)
        back = {"x0": torch.zeros(3), "x1": torch.zeros(3), "who": None}
        dcp.load(back, checkpoint_id=f"{root}/sub", process_group=group)
        out["sub"] = back
    dist.barrier()
    return out


def _torch_load_back(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    target = {"w": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1)]), "b": torch.zeros(5),
              "step": 0, "extra": {"lr": 0.0, "tags": None}}
    tdcp.load(target, checkpoint_id=f"{root}/torch_back")
    return {"w": target["w"].full_tensor(), "b": target["b"], "step": target["step"], "extra": target["extra"]}


def _torch_reference(path: Path) -> dict:
    """What torch's own single-process load gives for every key."""
    import warnings

    import torch.distributed.checkpoint as tdcp

    ref = _targets(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(ref, checkpoint_id=str(path), no_dist=True)
    return ref


def _assert_same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hyper_parallel_dcp.offline_transform.cli import main as convert

    root = tmp_path_factory.mktemp("torch-dcp")
    run_distributed(_torch_saves, 2, str(root), timeout=300)
    four = run_distributed(_ours_load_4, 4, str(root), timeout=300)
    assert convert(["dcp-to-torch-dcp", str(root / "ours"), str(root / "torch_back"), "--batch-size", "96", "-q"]) == 0
    back = run_distributed(_torch_load_back, 2, str(root), timeout=300)
    return root, four, back


def test_torch_checkpoints_load_on_4_ranks_in_another_layout(runs):
    root, four, _ = runs
    for name in ("torch_tp", "torch_fsdp"):
        ref = _torch_reference(root / name)
        assert any(k.startswith("optim.state.") for k in ref) or name == "torch_tp"
        assert ref["step"] == 7 and ref["extra.tags"] == ["a", "b"]
        for rank in range(4):
            _assert_same(four[rank][name], ref)


def test_torch_checkpoints_load_in_one_process_and_cast_to_bf16(runs):
    import hyper_parallel_dcp as dcp

    root, _, _ = runs
    for name in ("torch_tp", "torch_fsdp"):
        target = _targets(str(root / name))
        dcp.load(target, checkpoint_id=root / name)
        _assert_same(target, _torch_reference(root / name))
    ref = _torch_reference(root / "torch_tp")
    half = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in ref.items() if isinstance(v, torch.Tensor)}
    dcp.load(half, checkpoint_id=root / "torch_tp")
    for key, value in half.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, ref[key].to(torch.bfloat16)), key


def test_ours_converted_to_torch_dcp_loads_with_torch_in_another_layout(runs):
    _, _, back = runs
    for rank in range(2):
        assert torch.equal(back[rank]["w"], torch.arange(60.0).view(6, 10))
        assert torch.equal(back[rank]["b"], torch.arange(5.0))
        assert back[rank]["step"] == 7 and back[rank]["extra"] == {"lr": 0.1, "tags": ["a", "b"]}


def test_torch_dcp_to_dcp_conversion_gives_the_same_values_with_checksums(runs, tmp_path):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.offline_transform.cli import main as convert

    root, _, _ = runs
    dst = tmp_path / "converted"
    assert convert(["torch-dcp-to-dcp", str(root / "torch_fsdp"), str(dst), "--batch-size", "100", "-q"]) == 0
    assert (dst / ".metadata").read_bytes()[:1] == b"{"
    target = _targets(str(root / "torch_fsdp"))
    dcp.load(target, checkpoint_id=dst, verify=True)
    _assert_same(target, _torch_reference(root / "torch_fsdp"))
    # an existing DST is refused without --overwrite, exit 2, left as it was
    before = sorted(p.name for p in dst.iterdir())
    assert convert(["torch-dcp-to-dcp", str(root / "torch_fsdp"), str(dst), "-q"]) == 2
    assert sorted(p.name for p in dst.iterdir()) == before
    assert convert(["torch-dcp-to-dcp", str(tmp_path / "nothing"), str(tmp_path / "x"), "-q"]) == 1


def test_a_sub_group_saves_and_loads_with_its_group_ranks(runs):
    root, four, _ = runs
    for rank in (1, 3):
        sub = four[rank]["sub"]
        assert torch.equal(sub["x0"], torch.full((3,), 1.0)) and torch.equal(sub["x1"], torch.full((3,), 3.0))
        assert sub["who"] == "sub"
    assert {p.name for p in (root / "sub").iterdir() if p.suffix == ".safetensors"} == {
        "_rank0_.safetensors", "_rank1_.safetensors"}
