"""Every error of SPEC §8 is a clear exception naming the FQN / file — and, with several
ranks, an error on one rank is raised on every rank instead of leaving the others hanging."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MismatchError,
    MissingKeyError,
    UnsupportedTensorError,
)
from hyper_parallel_dcp.core.metadata import FORMAT_VERSION
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs.commit import SaveLock


def _state() -> dict:
    return {"layer": {"weight": torch.arange(24.0).view(4, 6), "bias": torch.ones(6)}, "step": 3}


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    import hyper_parallel_dcp as dcp

    path = tmp_path / "ckpt"
    dcp.save(_state(), checkpoint_id=path, no_dist=True)
    return path


def test_missing_directory_names_it(tmp_path):
    import hyper_parallel_dcp as dcp

    missing = tmp_path / "does-not-exist"
    with pytest.raises(CheckpointNotFoundError, match=str(missing)) as info:
        dcp.load({"x": torch.zeros(1)}, checkpoint_id=missing)
    assert isinstance(info.value, FileNotFoundError)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=rf"{empty}.*no checkpoint"):
        dcp.load({"x": torch.zeros(1)}, checkpoint_id=empty)


def test_a_directory_of_checkpoints_names_the_one_to_pass(tmp_path, capsys):
    """A CheckpointManager root (or a run's directory) passed where one checkpoint goes."""
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.cli import main as cli_main

    for step in (3, 12):
        dcp.save(_state(), checkpoint_id=tmp_path / f"step_{step}", no_dist=True)
    (tmp_path / "step_20").mkdir()  # an interrupted save: no .metadata
    hint = rf"directory of 2 checkpoint\(s\): pass one of them, e.g. the newest, {tmp_path}/step_12 "
    with pytest.raises(CheckpointNotFoundError, match=hint):
        dcp.load(_state(), checkpoint_id=tmp_path)
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert re.search(hint, capsys.readouterr().out)
    # a directory that holds nothing of the kind gets no hint
    with pytest.raises(CheckpointNotFoundError) as info:
        dcp.load(_state(), checkpoint_id=tmp_path / "step_20")
    assert "directory of" not in str(info.value)
    assert f"`hp-dcp ls {tmp_path}` lists them" in str(_load_error(tmp_path))


def _load_error(root) -> str:
    import hyper_parallel_dcp as dcp

    with pytest.raises(CheckpointNotFoundError) as info:
        dcp.load(_state(), checkpoint_id=root)
    return str(info.value)


def test_checkpoints_not_named_by_the_manager_get_a_command_that_finds_them(tmp_path, capsys):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.cli import main as cli_main

    for step in (5, 40):
        dcp.save(_state(), checkpoint_id=tmp_path / f"ckpt-{step}", no_dist=True)
    text = _load_error(tmp_path)
    assert f"directory of 2 checkpoint(s): pass one of them, e.g. the newest, {tmp_path}/ckpt-40 " in text
    assert f"`hp-dcp inspect {tmp_path}/ckpt-40` shows what it holds" in text and "hp-dcp ls" not in text
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "ckpt-40")]) == 0  # the command it suggests finds it

def test_missing_key_names_it_and_loads_nothing_silently(ckpt):
    import hyper_parallel_dcp as dcp

    with pytest.raises(MissingKeyError, match=r"'layer\.gamma' is not in the checkpoint") as info:
        dcp.load({"layer": {"weight": torch.zeros(4, 6), "gamma": torch.zeros(6)}}, checkpoint_id=ckpt)
    assert isinstance(info.value, KeyError)
    # which checkpoint, and how to load the rest anyway
    assert str(info.value).endswith(f"(checkpoint {ckpt})") and "allow_partial_load=True" in str(info.value)



@pytest.mark.filterwarnings("ignore::UserWarning")  # beta / deprecated tensor kinds
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_tensor_without_dense_data_is_named_and_nothing_is_written(tmp_path, how):
    """torch's own errors named no key ("Cannot copy out of meta tensor; no data!")."""
    import hyper_parallel_dcp as dcp

    odd = {"meta": (torch.empty(3, device="meta"), "is on the meta device and holds no data"),
           "sparse": (torch.eye(3).to_sparse(), "is a sparse_coo tensor"),
           "quantized": (torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), "has the quantized dtype")}
    for name, (tensor, why) in odd.items():
        path = tmp_path / name
        with pytest.raises(UnsupportedTensorError, match=rf"'model\.{name}'.* {why}"):
            result = getattr(dcp, how)({"model": {"ok": torch.ones(2), name: tensor}}, checkpoint_id=path)
            result.get_result(60)
        assert not (path / ".metadata").exists()
    # the next save goes through
    getattr(dcp, how)({"model": {"ok": torch.ones(2)}}, checkpoint_id=tmp_path / "fine")
    if how == "async_save":
        from hyper_parallel_dcp.async_persist import shutdown_writer

        shutdown_writer()
    assert (tmp_path / "fine" / ".metadata").exists()

def test_shape_mismatch_names_fqn_and_both_sides_and_a_dtype_is_cast(ckpt):
    import hyper_parallel_dcp as dcp

    with pytest.raises(MismatchError, match=r"'layer\.weight': shape mismatch: checkpoint has \[4, 6\], target expects \[6, 4\]") as info:
        dcp.load({"layer": {"weight": torch.zeros(6, 4)}}, checkpoint_id=ckpt)
    assert str(info.value).endswith(f"(checkpoint {ckpt})")
    # another dtype is cast by the copy, as torch.distributed.checkpoint does
    half = {"layer": {"bias": torch.zeros(6, dtype=torch.float16)}}
    dcp.load(half, checkpoint_id=ckpt)
    assert torch.equal(half["layer"]["bias"], _state()["layer"]["bias"].to(torch.float16))


def test_truncated_shard_file_is_named(ckpt):
    import hyper_parallel_dcp as dcp

    shard = ckpt / "_rank0_.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    target = {"layer": {"weight": torch.zeros(4, 6), "bias": torch.zeros(6)}}
    with pytest.raises(CorruptCheckpointError, match=r"_rank0_\.safetensors"):
        dcp.load(target, checkpoint_id=ckpt)


def test_corrupted_chunk_is_named_on_a_verified_load(ckpt):
    import hyper_parallel_dcp as dcp

    shard = ckpt / "_rank0_.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the last chunk's data; the size is unchanged
    shard.write_bytes(bytes(data))
    target = {"layer": {"weight": torch.zeros(4, 6), "bias": torch.zeros(6)}}
    with pytest.raises(CorruptCheckpointError, match=r"_rank0_\.safetensors.*'layer\.weight'"):
        dcp.load(target, checkpoint_id=ckpt, verify=True)


def test_newer_format_version_gives_both_versions(ckpt):
    import hyper_parallel_dcp as dcp

    meta = ckpt / ".metadata"
    doc = json.loads(meta.read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    meta.write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError) as info:
        dcp.load({"step": None}, checkpoint_id=ckpt)
    text = str(info.value)
    assert str(meta) in text and f"format_version {FORMAT_VERSION + 1}" in text and str(FORMAT_VERSION) in text


def test_partial_placement_on_save_names_the_fqn_single_rank():
    """One process, world 1 (no process group): Partial still refused with the FQN."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.core.errors import UnsupportedPlacementError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        with pytest.raises(UnsupportedPlacementError, match=r"'grad\.acc'.*Partial"):
            dcp.save({"grad": {"acc": partial}}, checkpoint_id="/nonexistent/never-written", no_dist=True)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ several ranks
def _one_rank_fails(rank: int, world_size: int, root: str) -> dict[str, tuple[bool, str]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    import hyper_parallel_dcp as dcp

    good = {"layer": {"weight": torch.zeros(4, 6), "bias": torch.zeros(6)}}
    cases = {
        "missing_key": {"layer": {"weight": torch.zeros(4, 6), "ghost": torch.zeros(2)}},
        "shape": {"layer": {"weight": torch.zeros(4, 7)}},
        "colliding_fqns": {"layer.bias": torch.zeros(6), "layer": {"bias": torch.zeros(6)}},
    }
    out = {}
    for name, bad in cases.items():
        target = bad if rank == 1 else good
        out[name] = _caught(lambda target=target: dcp.load(target, checkpoint_id=f"{root}/good"))
    # rank 1 looks in the wrong directory: rank 0 must not wait for it in the plan exchange
    path = f"{root}/good" if rank == 0 else f"{root}/not-there"
    out["missing_dir"] = _caught(lambda: dcp.load({"layer": {"bias": torch.zeros(6)}}, checkpoint_id=path))
    # a rank with nothing to load passes {}; only rank 1 touches the truncated file
    target = {"layer": {"weight": torch.zeros(4, 6)}} if rank == 1 else {}
    out["truncated"] = _caught(lambda: dcp.load(target, checkpoint_id=f"{root}/truncated"))
    mesh = init_device_mesh("cpu", (world_size,))
    placement = Partial() if rank == 1 else Replicate()
    grads = {"acc": DTensor.from_local(torch.ones(4), mesh, [placement], run_check=False)}
    out["partial"] = _caught(lambda: dcp.save(grads, checkpoint_id=f"{root}/partial"))
    # another save (the test process) holds the directory: the coordinator's refusal is
    # raised on rank 1 too, which would otherwise wait in the plan exchange
    out["locked"] = _caught(lambda: dcp.save({"w": torch.ones(2)}, checkpoint_id=f"{root}/locked"))
    # the group is still in step: a normal save and load work afterwards
    dcp.save({"w": torch.full((3,), float(world_size))}, checkpoint_id=f"{root}/after")
    after = {"w": torch.zeros(3)} if rank == 1 else {}  # rank 0 has nothing to load
    dcp.load(after, checkpoint_id=f"{root}/after")
    dist.barrier()
    ok = rank == 0 or bool(torch.equal(after["w"], torch.full((3,), float(world_size))))
    out["after"] = (ok, "")
    return out


def _caught(fn) -> tuple[bool, str]:
    """(raised a CheckpointError, message)."""
    try:
        fn()
    except CheckpointError as exc:
        return True, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a non-library error is a failure of the test
        return False, f"{type(exc).__name__}: {exc}"
    return False, "no error"


@pytest.mark.distributed
def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    import hyper_parallel_dcp as dcp

    dcp.save(_state(), checkpoint_id=tmp_path / "good", no_dist=True)
    dcp.save(_state(), checkpoint_id=tmp_path / "truncated", no_dist=True)
    shard = tmp_path / "truncated" / "_rank0_.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])

    lock = SaveLock(tmp_path / "locked")
    lock.acquire()
    try:
        results = run_distributed(_one_rank_fails, 2, str(tmp_path), timeout=240)
    finally:
        lock.release()
    expected = {
        "missing_dir": r"CheckpointNotFoundError.*rank\(s\) 1.*not-there",
        "missing_key": r"MissingKeyError.*rank\(s\) 1.*'layer\.ghost'",
        "shape": r"MismatchError.*rank\(s\) 1.*'layer\.weight': shape mismatch.*\[4, 6\].*\[4, 7\]",
        "colliding_fqns": r"ValueError.*rank\(s\) 1.*both flatten to the FQN 'layer\.bias'",
        "truncated": r"rank\(s\) 1.*_rank0_\.safetensors",
        "partial": r"UnsupportedPlacementError.*rank\(s\) 1.*'acc'.*Partial",
        "locked": r"ConcurrentSaveError.*rank\(s\) 0.*another save into \S*locked is in progress",
    }
    for rank, out in enumerate(results):
        for case, pattern in expected.items():
            raised, message = out[case]
            assert raised, f"rank {rank}, {case}: {message}"
            assert re.search(pattern, message, re.S), f"rank {rank}, {case}: {message}"
        assert out["after"] == (True, "")

