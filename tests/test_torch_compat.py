"""``hyper_parallel_dcp.torch_compat``: torch's save / async_save / load write and read our format.

Two gloo ranks save FSDP2 + Adam state (through ``get_state_dict``) plus objects with
``torch.distributed.checkpoint.save`` (with and without collectives) and ``async_save``
(thread and process executors) into our format; the checkpoints pass ``hp-dcp verify``
and load with our ``load`` in one process and on 2 ranks into another layout, bit-exact.
Our native 2-rank save loads with torch's ``load`` through the plugin into another
layout; a flipped byte fails a verified load through torch's API, naming file and FQN.
"""

from __future__ import annotations

import re

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_console_script, run_distributed

pytestmark = pytest.mark.distributed

OBJECTS = {"step": 7, "extra": {"lr": 0.1, "tags": ["a", "b"]}}
SAVES = ("sync", "thread", "process", "per_rank", "cached")


def _fsdp_state(world_size: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    torch.manual_seed(5 + torch.distributed.get_rank())
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    return mesh, {"model": model_sd, "optim": optim_sd, "bf16": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
                  **OBJECTS}


def _full(sd: dict) -> dict:
    """``sd`` flattened as torch stores it, each tensor leaf a full tensor."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(sd)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in flat.items()}


def _torch_saves(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import torch_compat
    from hyper_parallel_dcp.torch_compat import StorageWriter

    mesh, sd = _fsdp_state(world_size)
    tdcp.save(sd, storage_writer=StorageWriter(f"{root}/sync"))
    tdcp.async_save(sd, storage_writer=StorageWriter(f"{root}/thread")).result()
    tdcp.async_save(sd, storage_writer=StorageWriter(f"{root}/process"),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    tdcp.save(sd, storage_writer=StorageWriter(f"{root}/per_rank"), use_collectives=False)
    # as the integrations save: torch's plan cache on; the second save runs from the cached
    # plans, after a cached save of torch's own writer (whose plans must not be ours)
    torch_compat.save(sd, f"{root}/cached")
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(f"{root}/torch_cached"),
              planner=DefaultSavePlanner(enable_plan_caching=True))
    torch_compat.save(sd, f"{root}/cached")
    ours = {"w": distribute_tensor(torch.arange(60.0).view(6, 10), mesh, [Shard(0)]), "b": torch.arange(5.0),
            **OBJECTS}
    dcp.save(ours, checkpoint_id=f"{root}/native")
    return _full(sd)


def _targets(ref: dict, mesh=None) -> dict:
    """A zero target per key of ``ref``: sharded on the LAST dim over ``mesh`` (FSDP shards dim 0)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict = {}
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            zero = torch.zeros_like(value)
            out[key] = distribute_tensor(zero, mesh, [Shard(zero.ndim - 1)]) if mesh is not None and zero.ndim \
                else zero
        else:
            out[key] = None
    return out


def _loads(rank: int, world_size: int, root: str, ref: dict) -> dict:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import torch_compat
    from hyper_parallel_dcp.torch_compat import StorageReader

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in SAVES:  # the plugin's checkpoints, our load, another layout
        target = _targets(ref, mesh)
        dcp.load(target, checkpoint_id=f"{root}/{name}", verify=True)
        out[name] = _full(target)
    target = {"w": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1)]), "b": torch.zeros(5),
              "step": 0, "extra": {"lr": 0.0, "tags": None}}
    tdcp.load(target, storage_reader=StorageReader(f"{root}/native", verify=True))
    out["native"] = _full(target)
    target = _targets(ref, mesh)
    torch_compat.load(target, f"{root}/cached")  # the integrations' load (GC paused)
    out["cached_through_torch"] = _full(target)
    return out


def _assert_same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-compat")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}  # the process executor's group
    saved = run_distributed(_torch_saves, 2, str(root), timeout=300, env=env)
    assert torch.equal(saved[0]["model.0.weight"], saved[1]["model.0.weight"])
    loaded = run_distributed(_loads, 2, str(root), saved[0], timeout=300)
    return root, saved[0], loaded


def test_plugin_checkpoints_are_ours_and_verify(runs):
    root, ref, _ = runs
    for name in SAVES:
        path = root / name
        files = sorted(p.name for p in path.iterdir())
        if name == "per_rank":  # torch's use_collectives=False: every rank its own metadata, no dedup
            assert files == ["0.metadata", "1.metadata", "_rank0_.bytes", "_rank0_.safetensors", "_rank1_.bytes",
                             "_rank1_.safetensors"]
            continue
        assert (path / ".metadata").read_bytes()[:1] == b"{"  # our JSON, not torch's pickle
        assert files == [".metadata", "_rank0_.safetensors", "_rank1_.bytes", "_rank1_.safetensors"]
        done = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "verify", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "per_rank" / "0.metadata").read_bytes()[:1] == b"{"
    assert any(k.startswith("optim.state.") for k in ref) and ref["step"] == 7


def test_plugin_checkpoints_load_with_ours_in_one_process(runs):
    import hyper_parallel_dcp as dcp

    root, ref, _ = runs
    for name in SAVES:
        target = _targets(ref)
        dcp.load(target, checkpoint_id=root / name, verify=True)
        _assert_same(target, ref)


def test_plugin_checkpoints_load_with_ours_on_2_ranks_in_another_layout(runs):
    _, ref, loaded = runs
    for rank in range(2):
        for name in (*SAVES, "cached_through_torch"):
            _assert_same(loaded[rank][name], ref)


def test_native_checkpoint_loads_with_torch_through_the_plugin(runs):
    _, _, loaded = runs
    for rank in range(2):
        got = loaded[rank]["native"]
        assert torch.equal(got["w"], torch.arange(60.0).view(6, 10)) and torch.equal(got["b"], torch.arange(5.0))
        assert got["step"] == 7 and got["extra.lr"] == 0.1 and got["extra.tags"] == ["a", "b"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_round_trip_both_ways(tmp_path):
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.api import CheckpointException

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.core.errors import CorruptCheckpointError
    from hyper_parallel_dcp.torch_compat import StorageReader, StorageWriter

    sd = {"a": torch.randn(4, 6), "h": torch.arange(10, dtype=torch.float16), "o": {"lr": 0.1, "t": [1, 2]}}
    tdcp.save(sd, storage_writer=StorageWriter(tmp_path / "p"))
    dcp.save(sd, checkpoint_id=tmp_path / "n")
    for name in ("p", "n"):
        back = {"a": torch.zeros(4, 6), "h": torch.zeros(10, dtype=torch.float16), "o": {"lr": 0.0, "t": None}}
        tdcp.load(back, storage_reader=StorageReader(tmp_path / name, verify=True))
        assert torch.equal(back["a"], sd["a"]) and torch.equal(back["h"], sd["h"]) and back["o"] == sd["o"]
    # a flipped byte in a chunk: a verified load through torch's API names it
    shard = tmp_path / "p" / "_rank0_.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    back = {"a": torch.zeros(4, 6), "h": torch.zeros(10, dtype=torch.float16), "o": {"lr": 0.0, "t": None}}
    with pytest.raises(CheckpointException) as failed:  # torch wraps a failure in its BaseException
        tdcp.load(back, storage_reader=StorageReader(tmp_path / "p", verify=True))
    error = failed.value.failures[0][0]
    assert isinstance(error, CorruptCheckpointError)
    assert re.search(r"checksum mismatch in \S+_rank0_.safetensors: 'h' chunk", str(error)), str(error)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_planners_that_override_lookups_are_asked(tmp_path):
    """The plugin looks tensors up itself only for torch's own planners' lookups: a planner
    that overrides ``transform_object`` or ``commit_tensor`` sees every tensor."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from hyper_parallel_dcp.torch_compat import StorageReader, StorageWriter

    class Doubling(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return object * 2 if isinstance(object, torch.Tensor) else super().transform_object(write_item, object)

    class Recording(DefaultLoadPlanner):
        committed: list = []

        def commit_tensor(self, read_item, tensor):
            self.committed.append((read_item.dest_index.fqn, tensor.clone()))

    sd = {"a": torch.randn(4, 6), "o": 3}
    tdcp.save(sd, storage_writer=StorageWriter(tmp_path / "p"), planner=Doubling())
    back = {"a": torch.zeros(4, 6), "o": 0}
    tdcp.load(back, storage_reader=StorageReader(tmp_path / "p"), planner=Recording())
    assert torch.equal(back["a"], 2 * sd["a"]) and back["o"] == 3
    assert [fqn for fqn, _ in Recording.committed] == ["a"] and torch.equal(Recording.committed[0][1], 2 * sd["a"])
