"""End-to-end read-once + broadcast through ``hyper_parallel_dcp.load`` on real gloo ranks.

The checkpoint is written by one process from full tensors; each rank checks what it
loaded against slices of those full tensors taken with ``torch.chunk`` (independent of
the library's geometry), and reports how many bytes its reader took from storage.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed


def _save_full(path, full):
    from hyper_parallel_dcp.api import save

    save(full, checkpoint_id=path, no_dist=True)


def _object_bytes(path):
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    md = FileSystemReader(path).load_metadata()
    return sum(info.length for idx, info in md.storage_data.items() if idx.offset is None)


def _pg_count():
    import torch.distributed.distributed_c10d as c10d

    return len(c10d._world.pg_map)


# ----------------------------------------------------------------------------- DP only
def _dp_reference():
    g = torch.Generator().manual_seed(1)
    ref = {"embed": torch.randn(32, 16, generator=g), "head": torch.randn(16, 8, generator=g).bfloat16()}
    ref.update({f"layers.{i}.bias": torch.randn(5, generator=g) for i in range(12)})
    ref["optim"] = {"step": 40, "betas": (0.9, 0.95), "state": {"note": "dp"}}
    return ref


def _dp_targets(ref):
    sd = {k: torch.zeros_like(v) for k, v in ref.items() if isinstance(v, torch.Tensor)}
    sd["optim"] = {"step": 0, "betas": (0.0, 0.0), "state": {"note": ""}}
    return sd


def _check(sd, ref):
    bad = []
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            if not torch.equal(sd[k], v):
                bad.append(k)
        elif sd[k] != v:
            bad.append(k)
    return bad


def _dp_worker(rank, world_size, path, ref):
    from hyper_parallel_dcp.api import load
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    out = {}
    for name, flag in (("off", False), ("on", True)):
        sd = _dp_targets(ref)
        reader = FileSystemReader(path)
        before = _pg_count()
        load(sd, storage_reader=reader, broadcast_replicated_tensors=flag)
        out[name] = (_check(sd, ref), reader.bytes_read, _pg_count() - before)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_replicated_load_reads_each_byte_once(tmp_path, world_size):
    ref = _dp_reference()
    path = str(tmp_path / "ckpt")
    _save_full(path, ref)
    tensor_bytes = sum(v.numel() * v.element_size() for v in ref.values() if isinstance(v, torch.Tensor))
    objects = _object_bytes(path)

    results = run_distributed(_dp_worker, world_size, path, ref, timeout=240)

    for rank, out in enumerate(results):
        for name, (bad, _, leaked_groups) in out.items():
            assert bad == [], f"rank {rank} ({name}): wrong values for {bad}"
            assert leaked_groups == 0, f"rank {rank} ({name}): {leaked_groups} process groups left behind"
    off = sum(out["off"][1] for out in results)
    on = sum(out["on"][1] for out in results)
    assert off == world_size * tensor_bytes + world_size * objects
    assert on == tensor_bytes + world_size * objects


# ----------------------------------------------------------------------------- TP x DP
def _tpdp_reference():
    g = torch.Generator().manual_seed(2)
    return {
        "w_row": torch.randn(8, 6, generator=g),
        "w_col": torch.randn(4, 10, generator=g),
        "uneven": torch.randn(5, 3, generator=g),
        "ids": torch.randint(0, 99, (6, 2), generator=g),
        **{f"norm.{i}": torch.randn(4, generator=g) for i in range(10)},
        "step": 9,
    }


_TP_DIMS = {"w_row": 0, "w_col": 1, "uneven": 0, "ids": 0}


def _tpdp_targets(mesh, ref):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = mesh.get_local_rank("tp")
    sd = {}
    for k, v in ref.items():
        if not isinstance(v, torch.Tensor):
            sd[k] = 0
            continue
        dim = _TP_DIMS.get(k, 0)
        local = torch.zeros_like(torch.chunk(v, 2, dim)[tp])
        sd[k] = DTensor.from_local(local, mesh, [Replicate(), Shard(dim)], run_check=False,
                                   shape=v.shape, stride=v.stride())
    return sd


def _tpdp_check(mesh, sd, ref):
    tp = mesh.get_local_rank("tp")
    bad = []
    for k, v in ref.items():
        if not isinstance(v, torch.Tensor):
            if sd[k] != v:
                bad.append(k)
        elif not torch.equal(sd[k].to_local(), torch.chunk(v, 2, _TP_DIMS.get(k, 0))[tp]):
            bad.append(k)
    return bad


def _tpdp_worker(rank, world_size, path, ref):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel_dcp.api import load
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {}

    def run(name, **kwargs):
        sd = _tpdp_targets(mesh, ref)
        reader = FileSystemReader(path)
        before = _pg_count()
        load(sd, storage_reader=reader, **kwargs)
        out[name] = (_tpdp_check(mesh, sd, ref), reader.bytes_read, _pg_count() - before)

    run("off", broadcast_replicated_tensors=False)
    run("on")
    run("unbatched", broadcast_batch_bytes=0)
    run("tiny_batches", broadcast_batch_bytes=32)
    for i in range(3):
        run(f"repeat{i}")

    # Pre-built groups: dp replica pairs (0, 2) and (1, 3), built by every rank in one order.
    built = {}
    for ranks in ((0, 2), (1, 3)):
        group = dist.new_group(ranks=list(ranks))
        if rank in ranks:
            built[ranks] = group
    run("prebuilt", broadcast_groups=built)
    run("prebuilt_again", broadcast_groups=built)
    # the caller's groups are still alive and usable
    mine = next(iter(built.values()))
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe, group=mine)
    out["probe"] = probe.item()
    # Only the ranks of (0, 2) pass their group (the others pass None); (1, 3) is created
    # on demand for the load.
    run("partial", broadcast_groups=built if rank in (0, 2) else None)

    # A wrong group on one rank is refused on every rank (nobody is left in new_group).
    bad = {(0, 2): dist.group.WORLD} if rank == 0 else built
    try:
        load(_tpdp_targets(mesh, ref), checkpoint_id=path, broadcast_groups=bad)
        out["wrong_group"] = None
    except ValueError as exc:
        out["wrong_group"] = str(exc)
    try:
        load(_tpdp_targets(mesh, ref), checkpoint_id=path, broadcast_replicated_tensors=False, broadcast_groups=built)
        out["groups_without_flag"] = None
    except ValueError as exc:
        out["groups_without_flag"] = str(exc)
    return out


@pytest.mark.distributed
def test_tp_dp_layout_prebuilt_groups_and_repeated_loads(tmp_path):
    ref = _tpdp_reference()
    path = str(tmp_path / "ckpt")
    _save_full(path, ref)
    objects = _object_bytes(path)

    results = run_distributed(_tpdp_worker, 4, path, ref, timeout=300)

    loads = [k for k in results[0] if k not in ("probe", "wrong_group", "groups_without_flag")]
    for rank, out in enumerate(results):
        for name in loads:
            bad, _, leaked = out[name]
            assert bad == [], f"rank {rank} ({name}): wrong values for {bad}"
            assert leaked == 0, f"rank {rank} ({name}): {leaked} process groups left behind"
        assert out["probe"] == (0 + 2 if rank in (0, 2) else 1 + 3)
        assert out["wrong_group"] is not None and "broadcast_groups[(0, 2)]" in out["wrong_group"], out
        assert out["groups_without_flag"] is not None
    total = {name: sum(out[name][1] for out in results) for name in loads}
    # Every tensor is tp-sharded and dp-replicated (factor 2): each tp shard is read by two
    # ranks without broadcast and by one with it; objects are read by all four either way.
    assert total["off"] - 4 * objects == 2 * (total["on"] - 4 * objects)
    assert total["on"] > 4 * objects
    for name in loads:
        if name != "off":
            assert total[name] == total["on"], name
