"""hyper_parallel_dcp's entry points on s3:// (moto's S3 server on 127.0.0.1): a broadcast load
that fetches each replicated byte once (counted by a proxy), async_save, hp-dcp and
hp-dcp-convert on bucket URLs.  The storage package's own tests cover the rest."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

BUCKET = TEST_BUCKET
pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)




def _full():
    g = torch.Generator().manual_seed(7)
    return {"embed": torch.randn(64, 24, generator=g), "proj": torch.randn(24, 40, generator=g).bfloat16(),
            "bias": torch.randn(40, generator=g)}


# ----------------------------------------------------------------- broadcast reads once
def _broadcast_worker(rank, world_size, url, full):
    import hyper_parallel_dcp as dcp

    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=url, broadcast_replicated_tensors=True)
    return [k for k, v in full.items() if not torch.equal(sd[k], v)]


@pytest.mark.distributed
def test_broadcast_load_fetches_each_replicated_byte_once(s3_test_env, s3_proxy):
    import hyper_parallel_dcp as dcp

    url = f"s3://{BUCKET}/bcast"
    full = _full()
    dcp.save(full, checkpoint_id=url, no_dist=True)
    needed = sum(v.numel() * v.element_size() for v in full.values())
    s3_proxy.reset_counts()
    assert run_distributed(_broadcast_worker, 2, url, full, env=s3_test_env) == [[], []]
    fetched = s3_proxy.get_bytes[f"/{BUCKET}/bcast/_rank0_.safetensors"]
    # plain tensors are replicated on both ranks: one rank reads them, the other receives
    assert fetched == needed, (fetched, needed)


# ------------------------------------------------------------------------- async save
def test_async_save_to_s3(s3_test_env, s3_proxy):
    import hyper_parallel_dcp as dcp

    url = f"s3://{BUCKET}/async/step_5"
    full = _full()
    response = dcp.async_save(dict(full), checkpoint_id=url)
    response.get_result(timeout=120)
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=url)
    assert all(torch.equal(sd[k], full[k]) for k in full)


def _async_ranks_worker(rank, world_size, url, full):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"embed": distribute_tensor(full["embed"], mesh, [Shard(0)]), "bias": full["bias"]}
    dcp.async_save(sd, checkpoint_id=url).get_result(timeout=120)  # default arguments
    back = {"embed": distribute_tensor(torch.zeros_like(full["embed"]), mesh, [Shard(0)]),
            "bias": torch.zeros_like(full["bias"])}
    dcp.load(back, checkpoint_id=url)
    return torch.equal(back["embed"].full_tensor(), full["embed"]) and torch.equal(back["bias"], full["bias"])


@pytest.mark.distributed
def test_async_save_to_s3_on_two_ranks_with_default_arguments(s3_test_env):
    from hyper_parallel_dcp.core.testing import free_port_pair
    from hyper_parallel_dcp.storage_object import ObjectStore

    url = f"s3://{BUCKET}/async2/step_1"
    env = {**s3_test_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}  # torchrun's
    assert run_distributed(_async_ranks_worker, 2, url, _full(), env=env, timeout=240) == [True, True]
    names = sorted(key.rsplit("/", 1)[1] for key, _ in ObjectStore(BUCKET).list_objects("async2/step_1/"))
    assert names == [".metadata", "_rank0_.safetensors", "_rank1_.safetensors"]  # no mailbox objects


# ------------------------------------------------------------ hp-dcp and hp-dcp-convert
def test_tools_on_s3_urls(s3_test_env, s3_proxy, tmp_path, capsys):
    import json

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.cli import main as hp_dcp
    from hyper_parallel_dcp.offline_transform.cli import main as hp_dcp_convert

    full = _full()
    root = f"s3://{BUCKET}/tools"
    dcp.save(full, checkpoint_id=f"{root}/step_10", no_dist=True)
    dcp.save(full, checkpoint_id=f"{root}/step_20", no_dist=True)
    # an interrupted save: data object, no .metadata
    from hyper_parallel_dcp.storage_object import ObjectStore

    ObjectStore(BUCKET).put("tools/step_30/_rank0_.safetensors", b"partial")
    capsys.readouterr()
    assert hp_dcp(["latest", root]) == 0
    assert capsys.readouterr().out.strip() == f"{root}/step_20"
    assert hp_dcp(["inspect", f"{root}/step_30", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["complete"] is False
    assert hp_dcp(["inspect", f"{root}/step_20", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"]["proj"] == {"shape": [24, 40], "dtype": "bfloat16", "chunks": 1, "bytes": 24 * 40 * 2}
    # corrupt one byte of a copy: verify names the chunk
    store = ObjectStore(BUCKET)
    blob = bytearray(store.get("tools/step_20/_rank0_.safetensors"))
    store.put("tools/bad/.metadata", store.get("tools/step_20/.metadata"))
    blob[-1] ^= 0xFF
    store.put("tools/bad/_rank0_.safetensors", bytes(blob))
    assert hp_dcp(["verify", f"s3://{BUCKET}/tools/bad"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    # the converter reads from and writes to the bucket
    hf = tmp_path / "hf"
    assert hp_dcp_convert(["dcp-to-hf", f"{root}/step_20", str(hf), "--quiet"]) == 0
    back = f"s3://{BUCKET}/tools/from_hf"
    assert hp_dcp_convert(["hf-to-dcp", str(hf), back, "--quiet"]) == 0
    assert hp_dcp_convert(["hf-to-dcp", str(hf), back, "--quiet"]) == 2  # not empty, no --overwrite
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=back)
    assert all(torch.equal(sd[k], full[k]) for k in full)
