"""Save and load against a real S3 server (moto, in its own process on 127.0.0.1).

Values are checked against reference tensors built independently (``torch.chunk`` of
the full tensors); bytes are counted on the server side by a proxy in front of it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_object import ObjectStoreError, ObjectStoreSettings
from hyper_parallel_dcp.storage_object.testing import S3Proxy, create_bucket, free_port, s3_env, s3_server

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def server():
    with s3_server() as url:
        create_bucket(url, BUCKET)
        yield url


@pytest.fixture
def proxy(server):
    with S3Proxy(server) as p:
        yield p


@pytest.fixture
def env(proxy, monkeypatch):
    values = s3_env(proxy.url)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def _full():
    g = torch.Generator().manual_seed(7)
    return {"embed": torch.randn(64, 24, generator=g), "proj": torch.randn(24, 40, generator=g).bfloat16(),
            "bias": torch.randn(40, generator=g)}


# ------------------------------------------------------------- 4 ranks save, 2 ranks load
def _save_worker(rank, world_size, url, full):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"embed": distribute_tensor(full["embed"], mesh, [Shard(0)]),
          "proj": distribute_tensor(full["proj"], mesh, [Shard(1)]),
          "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
          "extra": {"step": 12, "rank_note": f"r{rank}"}}
    dcp.save(sd, checkpoint_id=url)


def _load_worker(rank, world_size, url, full):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"embed": distribute_tensor(torch.zeros(64, 24), mesh, [Shard(1)]),   # rows → columns
          "proj": distribute_tensor(torch.zeros(24, 40, dtype=torch.bfloat16), mesh, [Shard(0)]),
          "bias": distribute_tensor(torch.zeros(40), mesh, [Replicate()]),
          "extra": {"step": 0, "rank_note": ""}}
    dcp.load(sd, checkpoint_id=url)
    want = {"embed": full["embed"].chunk(world_size, 1)[rank], "proj": full["proj"].chunk(world_size, 0)[rank],
            "bias": full["bias"]}
    bad = [k for k, v in want.items() if not torch.equal(sd[k].to_local(), v)]
    return bad, sd["extra"]["step"]


@pytest.mark.distributed
def test_save_4_ranks_load_resharded_on_2(env, proxy):
    url = f"s3://{BUCKET}/run/step_1"
    full = _full()
    run_distributed(_save_worker, 4, url, full, env=env)
    results = run_distributed(_load_worker, 2, url, full, env=env)
    assert results == [([], 12), ([], 12)]
    # the hp-dcp tools read the bucket too
    out = subprocess.run([sys.executable, "-m", "hyper_parallel_dcp.cli", "verify", url], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# ----------------------------------------------------------------- broadcast reads once
def _broadcast_worker(rank, world_size, url, full, proxy_counts_path):
    import hyper_parallel_dcp as dcp

    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=url, broadcast_replicated_tensors=True)
    return [k for k, v in full.items() if not torch.equal(sd[k], v)]


@pytest.mark.distributed
def test_broadcast_load_fetches_each_replicated_byte_once(env, proxy):
    import hyper_parallel_dcp as dcp

    url = f"s3://{BUCKET}/bcast"
    full = _full()
    dcp.save(full, checkpoint_id=url, no_dist=True)
    needed = sum(v.numel() * v.element_size() for v in full.values())
    proxy.reset_counts()
    assert run_distributed(_broadcast_worker, 2, url, full, None, env=env) == [[], []]
    fetched = proxy.get_bytes[f"/{BUCKET}/bcast/_rank0_.safetensors"]
    # plain tensors are replicated on both ranks: one rank reads them, the other receives
    assert fetched == needed, (fetched, needed)


# ------------------------------------------------------------------------- async save
def test_async_save_to_s3(env, proxy):
    import hyper_parallel_dcp as dcp

    url = f"s3://{BUCKET}/async/step_5"
    full = _full()
    response = dcp.async_save(dict(full), checkpoint_id=url)
    response.get_result(timeout=120)
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=url)
    assert all(torch.equal(sd[k], full[k]) for k in full)


# ------------------------------------------------------------- replace, leftovers, kill
_KILLED_SAVE = textwrap.dedent("""
    import sys, torch, hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_object import ObjectStoreSettings, ObjectStoreWriter
    sd = {"big": torch.full((12 << 20,), 3.0), "other": torch.ones(10)}  # 48 MiB: multipart
    settings = ObjectStoreSettings(part_size=5 << 20, multipart_threshold=5 << 20, upload_concurrency=1)
    dcp.save(sd, storage_writer=ObjectStoreWriter(sys.argv[1], settings=settings), no_dist=True)
""")


def _list(proxy_url, prefix):
    import botocore.session

    client = botocore.session.get_session().create_client("s3", endpoint_url=proxy_url)
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    uploads = [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]
    return sorted(objects), uploads


def test_killed_save_leaves_no_metadata_and_next_save_cleans_up(env, proxy):
    import hyper_parallel_dcp as dcp

    url = f"s3://{BUCKET}/killed/step_2"
    old = {"a": torch.arange(10.0), "b": torch.ones(3)}
    dcp.save(old, checkpoint_id=url, no_dist=True)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, url], env={**os.environ, **env})
    try:
        assert proxy.first_part.wait(120), "the save never uploaded a part"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    objects, uploads = _list(proxy.url, "killed/")
    # documented rule: the old checkpoint is gone once a new save starts; no .metadata
    # describes objects that are not there
    assert "killed/step_2/.metadata" not in objects
    assert uploads == ["killed/step_2/_rank0_.safetensors"]  # the interrupted upload
    with pytest.raises(Exception, match="holds no checkpoint"):
        dcp.load({"a": torch.zeros(10)}, checkpoint_id=url)
    # the next save to the id removes the leftovers and commits a complete checkpoint
    new = {"c": torch.arange(6.0)}
    dcp.save(new, checkpoint_id=url, no_dist=True)
    objects, uploads = _list(proxy.url, "killed/")
    assert objects == ["killed/step_2/.metadata", "killed/step_2/_rank0_.safetensors"] and uploads == []
    sd = {"c": torch.zeros(6)}
    dcp.load(sd, checkpoint_id=url)
    assert torch.equal(sd["c"], new["c"])


# --------------------------------------------------------------------------- faults
@pytest.mark.parametrize("fault", ["503", "drop"])
def test_faulty_server_checkpoint_still_correct_and_retries_logged(server, monkeypatch, fault):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_object import ObjectStoreReader, ObjectStoreWriter

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("hyper_parallel_dcp.timing.storage_object")
    handler = Keep(level=logging.INFO)
    log.addHandler(handler)
    monkeypatch.setenv("HP_LOG_CONFIG", "DCP:INFO")
    settings = ObjectStoreSettings(part_size=5 << 20, multipart_threshold=5 << 20, range_size=1 << 20,
                                   backoff_base=0.01, read_timeout=10)
    try:
        with S3Proxy(server, fail_every=4, fault=fault) as proxy:
            for k, v in s3_env(proxy.url).items():
                monkeypatch.setenv(k, v)
            url = f"s3://{BUCKET}/faulty-{fault}"
            g = torch.Generator().manual_seed(3)
            full = {"big": torch.randn(3 << 20, generator=g), "w": torch.randn(50, 30, generator=g),
                    "opt": {"step": 9}}
            dcp.save(full, storage_writer=ObjectStoreWriter(url, settings=settings), no_dist=True)
            sd = {"big": torch.zeros(3 << 20), "w": torch.zeros(50, 30), "opt": {"step": 0}}
            dcp.load(sd, storage_reader=ObjectStoreReader(url, settings=settings, verify=True), no_dist=True)
            assert proxy.faults > 3
    finally:
        log.removeHandler(handler)
    assert torch.equal(sd["big"], full["big"]) and torch.equal(sd["w"], full["w"]) and sd["opt"]["step"] == 9
    retries = [r.getMessage() for r in records]
    assert len(retries) >= 3
    why = "HTTP 503 SlowDown" if fault == "503" else "Error"
    assert all("retry" in m and why in m and f"s3://{BUCKET}/faulty-{fault}" in m for m in retries), retries


# ------------------------------------------------------------------ permanent errors
def test_missing_bucket_names_it(env):
    import hyper_parallel_dcp as dcp

    started = time.monotonic()
    with pytest.raises(Exception, match="no-such-bucket") as info:
        dcp.save({"a": torch.ones(2)}, checkpoint_id="s3://no-such-bucket/x", no_dist=True)
    assert "does not exist" in str(info.value)
    with pytest.raises(ObjectStoreError, match="bucket 'no-such-bucket'"):
        dcp.load({"a": torch.ones(2)}, checkpoint_id="s3://no-such-bucket/x", no_dist=True)
    assert time.monotonic() - started < 30


def test_bad_credentials_name_bucket_and_key(monkeypatch):
    import hyper_parallel_dcp as dcp

    # moto checks signatures only with authentication switched on
    with s3_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        for k, v in s3_env(url).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ObjectStoreError, match=r"bucket 'ckpts', key 'run/\.metadata'.*InvalidAccessKeyId"):
            dcp.load({"a": torch.ones(2)}, checkpoint_id="s3://ckpts/run", no_dist=True)


def test_unreachable_endpoint_fails_within_the_timeout(monkeypatch):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_object import ObjectStoreReader

    dead = f"http://127.0.0.1:{free_port()}"
    for k, v in s3_env(dead).items():
        monkeypatch.setenv(k, v)
    settings = ObjectStoreSettings(max_attempts=3, backoff_base=0.05, connect_timeout=2)
    started = time.monotonic()
    with pytest.raises(ObjectStoreError, match=rf"GET s3://ckpts/run/\.metadata .*after 3 attempts.*{dead}"):
        dcp.load({"a": torch.ones(2)}, storage_reader=ObjectStoreReader("s3://ckpts/run", settings=settings),
                 no_dist=True)
    assert time.monotonic() - started < 20


# ------------------------------------------------------------ hp-dcp and hp-dcp-convert
def test_tools_on_s3_urls(env, proxy, tmp_path, capsys):
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
