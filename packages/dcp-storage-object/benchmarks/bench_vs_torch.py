"""s3:// save and load: hyper-parallel-dcp vs torch.distributed.checkpoint's fsspec (s3fs).

Both write the same state dict to the same local S3 server (moto, its own process on
127.0.0.1) and load it back; best of ``--repeat``.  Then the bytes a resharded load
fetches, counted on the server side by a proxy: saved on 4 ranks (rows sharded), loaded
on 2 ranks as rows and as columns, against the bytes the 2 ranks' targets need.

    python packages/dcp-storage-object/benchmarks/bench_vs_torch.py --mib 64
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_object.testing import S3Proxy, create_bucket, s3_env, s3_server

BUCKET = "bench"


def _state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = max(1, (mib << 20) // tensors // (1024 * 4))
    return {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(tensors)}


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _fsspec_writer(url: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not re-exported in 2.13

    return FsspecWriter(url, overwrite=True)


def _fsspec_reader(url: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url)


def timing(sd: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    import torch.distributed.checkpoint as tdcp

    import hyper_parallel_dcp as dcp

    target = {k: torch.empty_like(v) for k, v in sd.items()}
    out = {}
    out["ours_save"] = _best(lambda: dcp.save(sd, checkpoint_id=f"s3://{BUCKET}/ours", no_dist=True), repeat)
    out["torch_save"] = _best(lambda: tdcp.save(sd, storage_writer=_fsspec_writer(f"s3://{BUCKET}/theirs")), repeat)
    out["ours_load"] = _best(lambda: dcp.load(target, checkpoint_id=f"s3://{BUCKET}/ours", no_dist=True), repeat)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    out["torch_load"] = _best(lambda: tdcp.load(target, storage_reader=_fsspec_reader(f"s3://{BUCKET}/theirs")),
                              repeat)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    return out


def _mesh_state(full, world_size, dim):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {k: distribute_tensor(v, mesh, [Shard(dim)]) for k, v in full.items()}


def _save4(rank, world_size, full, ours_url, theirs_url):
    import torch.distributed.checkpoint as tdcp

    import hyper_parallel_dcp as dcp

    sd = _mesh_state(full, world_size, 0)
    dcp.save(sd, checkpoint_id=ours_url)
    tdcp.save(sd, storage_writer=_fsspec_writer(theirs_url))


def _load2(rank, world_size, full, url, which, dim):
    import torch.distributed.checkpoint as tdcp

    import hyper_parallel_dcp as dcp

    sd = _mesh_state({k: torch.zeros_like(v) for k, v in full.items()}, world_size, dim)
    if which == "ours":
        dcp.load(sd, checkpoint_id=url)
    else:
        tdcp.load(sd, storage_reader=_fsspec_reader(url))
    ok = all(torch.equal(sd[k].to_local(), full[k].chunk(world_size, dim)[rank]) for k in full)
    return ok, sum(t.to_local().numel() * t.to_local().element_size() for t in sd.values())


def resharded_bytes(proxy: S3Proxy, env: dict[str, str], full) -> dict[str, float]:
    run_distributed(_save4, 4, full, f"s3://{BUCKET}/r-ours", f"s3://{BUCKET}/r-theirs", env=env, timeout=600)
    out = {}
    for which in ("ours", "torch"):
        prefix = "r-ours" if which == "ours" else "r-theirs"
        for dim, name in ((0, "rows"), (1, "columns")):
            proxy.reset_counts()
            got = run_distributed(_load2, 2, full, f"s3://{BUCKET}/{prefix}", which, dim, env=env, timeout=600)
            assert all(ok for ok, _ in got), f"{which} {name}: wrong values"
            needed = sum(n for _, n in got)
            fetched = sum(n for key, n in proxy.get_bytes.items()
                          if key.startswith(f"/{BUCKET}/{prefix}/") and not key.endswith("metadata"))
            out[f"{which}_{name}"] = fetched / needed
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="state dict size")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip-reshard", action="store_true")
    a = p.parse_args()
    sd = _state(a.mib, a.tensors)
    with s3_server() as url:
        create_bucket(url, BUCKET)
        os.environ.update(s3_env(url))
        t = timing(sd, a.repeat)
        print(f"{a.mib} MiB in {a.tensors} tensors, best of {a.repeat}:")
        print(f"  save  ours {t['ours_save']:.2f} s   torch fsspec {t['torch_save']:.2f} s   "
              f"-> {t['torch_save'] / t['ours_save']:.2f}x")
        print(f"  load  ours {t['ours_load']:.2f} s   torch fsspec {t['torch_load']:.2f} s   "
              f"-> {t['torch_load'] / t['ours_load']:.2f}x", flush=True)
        if a.skip_reshard:
            return
        with S3Proxy(url) as proxy:
            env = s3_env(proxy.url)
            full = _state(max(4, a.mib // 4), 4)
            ratios = resharded_bytes(proxy, env, full)
        print("  resharded load (saved on 4 ranks, rows; loaded on 2), bytes fetched / bytes needed:")
        for which in ("ours", "torch"):
            print(f"    {which:5s} rows {ratios[f'{which}_rows']:.2f}x   columns {ratios[f'{which}_columns']:.2f}x")


if __name__ == "__main__":
    main()
