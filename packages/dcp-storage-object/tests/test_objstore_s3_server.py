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
from hyper_parallel_dcp.storage_object import ObjectStoreError, ObjectStoreSettings, ObjectStoreWriter
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET, S3Proxy, free_port, s3_env, s3_server

BUCKET = TEST_BUCKET
pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)


def _save(state_dict, url, writer=None):
    from hyper_parallel_dcp.core.backends import storage_writer_for
    from hyper_parallel_dcp.core.pipeline import save_state_dict

    return save_state_dict(state_dict, storage_writer_for(url, writer), no_dist=True)


def _load(state_dict, url, reader=None, no_dist=True):
    from hyper_parallel_dcp.core.backends import storage_reader_for
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    load_state_dict(state_dict, storage_reader_for(url, reader), no_dist=no_dist)




def _full():
    g = torch.Generator().manual_seed(7)
    return {"embed": torch.randn(64, 24, generator=g), "proj": torch.randn(24, 40, generator=g).bfloat16(),
            "bias": torch.randn(40, generator=g)}


# ------------------------------------------------------------- 4 ranks save, 2 ranks load
def _save_worker(rank, world_size, url, full):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hyper_parallel_dcp.core.backends import storage_writer_for
    from hyper_parallel_dcp.core.pipeline import save_state_dict

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"embed": distribute_tensor(full["embed"], mesh, [Shard(0)]),
          "proj": distribute_tensor(full["proj"], mesh, [Shard(1)]),
          "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
          "extra": {"step": 12, "rank_note": f"r{rank}"}}
    save_state_dict(sd, storage_writer_for(url, None))


def _load_worker(rank, world_size, url, full):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"embed": distribute_tensor(torch.zeros(64, 24), mesh, [Shard(1)]),   # rows → columns
          "proj": distribute_tensor(torch.zeros(24, 40, dtype=torch.bfloat16), mesh, [Shard(0)]),
          "bias": distribute_tensor(torch.zeros(40), mesh, [Replicate()]),
          "extra": {"step": 0, "rank_note": ""}}
    _load(sd, url, no_dist=False)
    want = {"embed": full["embed"].chunk(world_size, 1)[rank], "proj": full["proj"].chunk(world_size, 0)[rank],
            "bias": full["bias"]}
    bad = [k for k, v in want.items() if not torch.equal(sd[k].to_local(), v)]
    return bad, sd["extra"]["step"]


@pytest.mark.distributed
def test_save_4_ranks_load_resharded_on_2(s3_test_env, s3_proxy):
    url = f"s3://{BUCKET}/run/step_1"
    full = _full()
    run_distributed(_save_worker, 4, url, full, env=s3_test_env)
    results = run_distributed(_load_worker, 2, url, full, env=s3_test_env)
    assert results == [([], 12), ([], 12)]
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    report = verify_checkpoint(url)
    # rows, columns, bias once, the step once, rank_note (it differs) once per rank
    assert report.ok and report.chunks_checked == 4 + 4 + 1 + 1 + 4, report


# ------------------------------------------------------------- replace, leftovers, kill
_KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    from hyper_parallel_dcp.storage_object import ObjectStoreSettings, ObjectStoreWriter
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    sd = {"big": torch.full((12 << 20,), 3.0), "other": torch.ones(10)}  # 48 MiB: multipart
    settings = ObjectStoreSettings(part_size=5 << 20, multipart_threshold=5 << 20, upload_concurrency=1)
    save_state_dict(sd, ObjectStoreWriter(sys.argv[1], settings=settings), no_dist=True)
""")


def _list(proxy_url, prefix):
    import botocore.session

    client = botocore.session.get_session().create_client("s3", endpoint_url=proxy_url)
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    uploads = [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]
    return sorted(objects), uploads


def test_killed_save_leaves_no_metadata_and_next_save_cleans_up(s3_test_env, s3_proxy):
    url = f"s3://{BUCKET}/killed/step_2"
    old = {"a": torch.arange(10.0), "b": torch.ones(3)}
    _save(old, url)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, url], env={**os.environ, **s3_test_env})
    try:
        assert s3_proxy.first_part.wait(120), "the save never uploaded a part"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    objects, uploads = _list(s3_proxy.url, "killed/")
    # documented rule: the old checkpoint is gone once a new save starts; no .metadata
    # describes objects that are not there
    assert "killed/step_2/.metadata" not in objects
    assert uploads == ["killed/step_2/_rank0_.safetensors"]  # the interrupted upload
    with pytest.raises(Exception, match="holds no checkpoint"):
        _load({"a": torch.zeros(10)}, url)
    # the next save to the id removes the leftovers and commits a complete checkpoint
    new = {"c": torch.arange(6.0)}
    # the killed save's lock object is still there, fresh (60 s by default) but its holder,
    # on this machine, is gone: taken over at once rather than after it turns stale
    assert "killed/.step_2.hp-dcp-lock" in objects
    started = time.monotonic()
    _save(new, None, ObjectStoreWriter(url, settings=ObjectStoreSettings(lock_stale_after=600)))
    assert time.monotonic() - started < 60
    objects, uploads = _list(s3_proxy.url, "killed/")
    assert objects == ["killed/step_2/.metadata", "killed/step_2/_rank0_.safetensors"] and uploads == []
    sd = {"c": torch.zeros(6)}
    _load(sd, url)
    assert torch.equal(sd["c"], new["c"])


# --------------------------------------------------------------------------- faults
@pytest.mark.parametrize("fault", ["503", "drop"])
def test_faulty_server_checkpoint_still_correct_and_retries_logged(s3_endpoint, monkeypatch, fault):
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
        with S3Proxy(s3_endpoint, fail_every=4, fault=fault) as proxy:
            for k, v in s3_env(proxy.url).items():
                monkeypatch.setenv(k, v)
            url = f"s3://{BUCKET}/faulty-{fault}"
            g = torch.Generator().manual_seed(3)
            full = {"big": torch.randn(3 << 20, generator=g), "w": torch.randn(50, 30, generator=g),
                    "opt": {"step": 9}}
            _save(full, None, ObjectStoreWriter(url, settings=settings))
            sd = {"big": torch.zeros(3 << 20), "w": torch.zeros(50, 30), "opt": {"step": 0}}
            _load(sd, None, ObjectStoreReader(url, settings=settings, verify=True))
            assert proxy.faults > 3
    finally:
        log.removeHandler(handler)
    assert torch.equal(sd["big"], full["big"]) and torch.equal(sd["w"], full["w"]) and sd["opt"]["step"] == 9
    retries = [r.getMessage() for r in records]
    assert len(retries) >= 3
    why = "HTTP 503 SlowDown" if fault == "503" else "Error"
    assert all("retry" in m and why in m and f"s3://{BUCKET}/faulty-{fault}" in m for m in retries), retries


# ------------------------------------------------------------------ permanent errors
def test_missing_bucket_names_it(s3_test_env):
    started = time.monotonic()
    with pytest.raises(Exception, match="no-such-bucket") as info:
        _save({"a": torch.ones(2)}, "s3://no-such-bucket/x")
    assert "does not exist" in str(info.value)
    with pytest.raises(ObjectStoreError, match="bucket 'no-such-bucket'"):
        _load({"a": torch.ones(2)}, "s3://no-such-bucket/x")
    assert time.monotonic() - started < 30


def test_a_key_or_shape_the_checkpoint_lacks_names_the_url(s3_test_env):
    from hyper_parallel_dcp.core import CheckpointNotFoundError, MismatchError, MissingKeyError

    url = f"s3://{BUCKET}/names-the-url"
    _save({"a": torch.ones(2, 3)}, url)
    with pytest.raises(MissingKeyError, match=r"key 'b' is not in the checkpoint") as info:
        _load({"a": torch.zeros(2, 3), "b": torch.zeros(1)}, url)
    assert str(info.value).endswith(f"(checkpoint {url})")
    with pytest.raises(MismatchError, match=r"target expects \[3, 2\]") as info:
        _load({"a": torch.zeros(3, 2)}, url)
    assert str(info.value).endswith(f"(checkpoint {url})")
    # the run's directory instead of one of its steps: the message names the step to pass
    root = f"s3://{BUCKET}/a-run-root"
    for step in (2, 10):
        _save({"a": torch.ones(2, 3)}, f"{root}/step_{step}")
    with pytest.raises(CheckpointNotFoundError, match=rf"directory of 2 checkpoint\(s\).* the newest, {root}/step_10 "):
        _load({"a": torch.zeros(2, 3)}, root)


def test_bad_credentials_name_bucket_and_key(monkeypatch):
    # moto checks signatures only with authentication switched on
    with s3_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        for k, v in s3_env(url).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ObjectStoreError, match=r"bucket 'ckpts', key 'run/\.metadata'.*InvalidAccessKeyId"):
            _load({"a": torch.ones(2)}, "s3://ckpts/run")


def test_unreachable_endpoint_fails_within_the_timeout(monkeypatch):
    from hyper_parallel_dcp.storage_object import ObjectStoreReader

    dead = f"http://127.0.0.1:{free_port()}"
    for k, v in s3_env(dead).items():
        monkeypatch.setenv(k, v)
    settings = ObjectStoreSettings(max_attempts=3, backoff_base=0.05, connect_timeout=2)
    started = time.monotonic()
    with pytest.raises(ObjectStoreError, match=rf"GET s3://ckpts/run/\.metadata .*after 3 attempts.*{dead}"):
        _load({"a": torch.ones(2)}, None, ObjectStoreReader("s3://ckpts/run", settings=settings))
    assert time.monotonic() - started < 20


def test_missing_credentials_name_the_variables_and_the_guide(s3_endpoint, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                 "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")
                 }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ObjectStoreError, match=r"bucket 'ckpts', key 'run/\.metadata'.*AWS_ACCESS_KEY_ID and "
                       r"AWS_SECRET_ACCESS_KEY \(and AWS_ENDPOINT_URL .*docs/object-storage\.md"):
        _load({"a": torch.ones(2)}, f"s3://{BUCKET}/run")



# -------------------------------------------- what checkpoint retention needs from a root
def test_object_files_primitives_for_a_root_of_steps(s3_test_env, s3_proxy):
    from hyper_parallel_dcp.storage_fs.files import as_checkpoint_files
    from hyper_parallel_dcp.storage_fs.integrity import check_complete, find_latest_checkpoint
    from hyper_parallel_dcp.storage_object import ObjectFiles, ObjectStore

    root_url = f"s3://{BUCKET}/mgr"
    for step in (1, 2):
        _save({"w": torch.full((100,), float(step))}, f"{root_url}/step_{step}")
    ObjectStore(BUCKET).put("mgr/step_3/_rank0_.safetensors", b"leftover")  # interrupted save
    ObjectStore(BUCKET).put("mgr/notes.txt", b"keep me")
    root = as_checkpoint_files(root_url)
    assert isinstance(root, ObjectFiles)
    assert sorted(root.entries()) == [("notes.txt", 7), ("step_1", None), ("step_2", None), ("step_3", None)]
    assert [check_complete(root.child(f"step_{s}")).complete for s in (1, 2, 3)] == [True, True, False]
    assert find_latest_checkpoint(root) == f"{root_url}/step_2"
    step2 = root.child("step_2")
    assert step2.total_size() == sum(size for _, size in step2.entries())
    root.child("step_3").remove()
    root.child("step_1").remove()
    assert sorted(root.entries()) == [("notes.txt", 7), ("step_2", None)]
    sd = {"w": torch.zeros(100)}
    _load(sd, f"{root_url}/step_2")
    assert torch.equal(sd["w"], torch.full((100,), 2.0))
